"""`dsrecipes chat MODEL`: talk to a trained model in the terminal, with the template it was trained on.

MODEL is any export kind (inference.py): a run directory, a full or merged export, an adapter-only LoRA export, a
base model directory. Replies stream token by token and end at the template's end-of-turn token; the conversation is
kept, so each turn sees the previous ones. `/reset` starts over, `/exit` (or Ctrl-D) quits. `--message TEXT` asks
one question and exits (scripts and tests); a line on stderr says whether the reply ended at end of turn or was cut
by --max-new-tokens.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List

from dsrecipes.boundary.trust import FLAG, TRUST_HELP, trust
from dsrecipes.commands.args import MAX_NEW_TOKENS, bounded_int, command_parser, existing_path, parse
from dsrecipes.core.errors import visible


def main(argv: List[str]) -> int:
    from dsrecipes.serve.inference import (  # lazy: else `commands.chat` imports torch 3.80 s, numpy 0.11 s
        ChatModel,
        resolve_model_path,
    )

    parser = command_parser("chat", __doc__.split("\n")[0])
    parser.add_argument("model", help="run dir, export, merged or adapter-only LoRA export, or a model dir")
    parser.add_argument("--message", default=None, help="one user message: answer it and exit")
    parser.add_argument("--system", default=None, help="system prompt (default: the template's, if any)")
    parser.add_argument("--max-new-tokens", type=bounded_int(MAX_NEW_TOKENS, "tokens generated per reply"), default=256,
                        help="reply length cap (default 256)")
    parser.add_argument(FLAG, action="append", default=[], type=existing_path, metavar="PATH", help=TRUST_HELP)
    args = parse(parser, argv)
    trust(args.trust_checkpoint)
    model = ChatModel(resolve_model_path(args.model, retry=f"dsrecipes chat {args.model}"))
    history: List[Dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
    if args.message is not None:
        reply_turn(model, history, args.message, args.max_new_tokens)
        return 0
    stops = ", ".join(repr(model.tokenizer.convert_ids_to_tokens(i)) for i in model.stop_ids)
    print(f"chatting with {model.where.path} (stops at {stops}); /reset starts over, /exit or Ctrl-D quits",
          file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            del history[int(bool(args.system)):]
            continue
        if line.strip():
            reply_turn(model, history, line, args.max_new_tokens)


def reply_turn(model: Any, history: List[Dict[str, Any]], message: str, max_new_tokens: int) -> str:
    """Answer `message` after `history` (streamed to stdout); both turns are appended to `history`."""
    history.append({"role": "user", "content": message})
    prompt_ids = model.encode(model.prompt_text(history))
    new_ids = model.generate(prompt_ids, max_new_tokens, streamer=_visible_streamer(model.tokenizer))
    sys.stdout.flush()
    answer = model.answer_text(new_ids)
    history.append({"role": "assistant", "content": answer})
    ended = bool(new_ids) and new_ids[-1] in model.stop_ids
    how = (f"end of turn {model.tokenizer.convert_ids_to_tokens(new_ids[-1])!r}" if ended
           else f"cut at --max-new-tokens {max_new_tokens}")
    print(f"[{len(new_ids)} tokens, {how}]", file=sys.stderr)
    return answer


def _visible_streamer(tokenizer: Any) -> Any:
    """transformers' TextStreamer printing the reply with its control characters escaped (errors.visible): a
    model's ESC sequences (window title, clipboard OSC 52, clear screen) never reach the terminal as such."""
    from transformers import TextStreamer

    class VisibleStreamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            super().on_finalized_text(visible(text), stream_end)

    return VisibleStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
