"""Where a LLaMA-Factory key's twin here trains otherwise, said in the key's line (config/foreign_keys.RULES): the
texts, kept apart so that the table stays a table."""

from __future__ import annotations

from typing import Any

PACKING = ("data.packing: true (packed samples attend only within themselves here, as with LLaMA-Factory's "
           "neat_packing; its packing alone lets them attend to each other)")
MASK_HISTORY = ("data.train_on: last_assistant (only the final assistant turn; like LLaMA-Factory's mask_history, "
                "which keeps the last turn and cuts the history, a conversation whose last reply would fall past "
                "data.cutoff_len drops earlier turns instead; here whole exchanges from the start and never the "
                "system prompt or tools, where LLaMA-Factory also cuts inside a turn and may cut the system prompt, "
                "so a row whose system prompt, tools and last prompt turn alone fill the cutoff is dropped here)")
GRAD_ACCUM = (" (each trained token of the step weighs the same across its micro-batches and ranks, as with "
              "LLaMA-Factory's Trainer, transformers >= 4.46: objective.loss_average: tokens, the default)")


def grad_accum(value: Any) -> str:
    """What `gradient_accumulation_steps: N` adds to `trainer.grad_accum: N`: how a step of N > 1 micro-batches
    weighs their losses, the same as LF's Trainer (num_items_in_batch) since objective.loss_average=tokens."""
    return GRAD_ACCUM if isinstance(value, int) and not isinstance(value, bool) and value > 1 else ""


# LLaMA-Factory templates whose assistant format ends with a newline after the end-of-turn token (format_assistant in
# its src/llamafactory/data/template.py: chatml's family "{{content}}<|im_end|>\n", alpaca "{{content}}", eos, "\n\n",
# gemma "{{content}}<end_of_turn>\n", phi "{{content}}<|end|>\n", ...). Its supervised processor trains the whole
# assistant format (target_ids), newline included; ours write that text untrained unless template.train_eot_newline.
# Not here: llama3 "<|eot_id|>", llama4, hunyuan, phi4, vicuna/mistral/llama2 (content + eos), empty: nothing after;
# default's "\n" after eos (human_assistant's replies end at eos: nothing to train); glm4, chatglm3, falcon: no
# end-of-turn token in the reply.
EOT_NEWLINE = ("chatml", "chatml_de", "dbrx", "opencoder", "qwen", "qwen3", "qwen3_nothink", "yi", "alpaca", "gemma",
               "gemma2", "gemma3", "phi", "phi_small", "deepseekcoder", "granite3", "intern2", "starchat", "qwen2_vl",
               "qwen2_audio", "minicpm_v", "sailor")


def eot_newline(name: str) -> str:
    """What LLaMA-Factory's `template: NAME` line adds where LF trains the newline after the end-of-turn token."""
    if name not in EOT_NEWLINE:
        return ""
    return (f"; LLaMA-Factory's {name} trains the newline after the end-of-turn token with every reply (its "
            "format_assistant ends with it): template.train_eot_newline: true trains it here too")
