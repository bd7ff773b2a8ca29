"""`train_on=last_assistant`: a conversation that would lose its last reply to `data.cutoff_len` loses history instead.

The ordinary truncation (tokenize.py) keeps a conversation's head, so under `last_assistant` (only the final reply
is trained) a row whose last reply starts past the cutoff has nothing trained and would be dropped. LLaMA-Factory's
`mask_history` encodes the turn pairs last first (data/processor/supervised.py `_encode_data_example`:
`encoded_pairs[::-1]`), so the last turn gets the budget and the history is cut. Here such a row (and only such a
row: every row the ordinary rule keeps is encoded as before) drops whole exchanges from the start of its history:

- the candidates are the conversation from each later user turn on (an exchange starts at a user turn, so tool calls
  and their observations stay with the exchange they belong to), with the same system prompt and tools;
- each candidate is rendered by the run's template and tokenized as a conversation of its own (never a slice of the
  full rendering's tokens: a template may fold the system prompt into the first user turn, or open differently), so
  its tokens and labels are exactly what the template gives that shorter conversation;
- the sample is the candidate keeping the most history whose last reply ends within `cutoff_len` (found by bisection,
  one rendering round per step for the whole batch: the fewer turns, the shorter the sample);
- when not even the last exchange alone fits whole, that exchange takes the ordinary rule: cut mid-reply at the
  cutoff when its reply starts before it, else (the system prompt, tool schemas and last prompt turn fill the
  cutoff: they are never dropped, a prompt without them asks another question) the row is dropped as before and
  counted with `dropped_all_trained_cut`. A candidate the template or tokenizer refuses is never used: then the
  row is dropped as before too.

LLaMA-Factory also cuts inside turns (`infer_seqlen` gives the history's oldest kept pair a truncated source and
target, and the system prompt lives in the first pair, so a long history loses it); here only whole exchanges go and
the system prompt and tools stay.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.data.sources.sharegpt import Conversation, Role

Rendered = Tuple[List[Any], Tuple[np.ndarray, List[int]]]  # (segments, (token ids, segment starts))


def cut_history(encoder: Any, convs: Sequence[Conversation], rendered: List[Optional[List[Any]]],
                spans: List[Optional[Any]]) -> np.ndarray:
    """Replace, in place, the rendering and spans of each conversation that would lose its last reply to the cutoff
    by those of its shortened conversation (see the module comment); True where one was replaced. `encoder` is the
    run's tokenize.Encoder."""
    cut = np.zeros(len(convs), dtype=bool)
    starts: Dict[int, List[int]] = {}
    for i, (segs, span) in enumerate(zip(rendered, spans)):
        if segs and span is not None and span[1][-1] > encoder.cutoff_len and _loses_last_reply(encoder, segs, span):
            later = [k for k, turn in enumerate(convs[i].turns) if k > 0 and turn.role is Role.user]
            if later:
                starts[i] = later
    for i, best in _bisect(encoder, convs, starts).items():
        if best is not None and encoder.kept(best[0], best[1][1])[0]:  # something trained is left
            rendered[i], spans[i] = best
            cut[i] = True
    return cut


def _loses_last_reply(encoder: Any, segs: List[Any], span: Any) -> bool:
    """Whether the ordinary truncation leaves nothing trained of a conversation that has a trained reply."""
    keep, full = encoder.kept(segs, span[1])
    return keep == 0 and full > 0


def _bisect(encoder: Any, convs: Sequence[Conversation], starts: Dict[int, List[int]]) -> Dict[int, Optional[Rendered]]:
    """{conversation: the rendering and spans of its first candidate (the most history) whose last reply ends within
    the cutoff, else of its last candidate (the last exchange alone); None: the template or tokenizer refused it}.
    Bisection over each conversation's candidates, one step of every conversation rendered together."""
    lo = {i: 0 for i in starts}
    hi = {i: len(later) for i, later in starts.items()}
    got: Dict[Tuple[int, int], Optional[Rendered]] = {}
    pending = list(starts)
    while pending:
        steps = [(i, (lo[i] + hi[i]) // 2) for i in pending]
        shorter = [dataclasses.replace(convs[i], turns=list(convs[i].turns[starts[i][j]:])) for i, j in steps]
        for (i, j), one in zip(steps, _render(encoder, shorter)):
            got[i, j] = one
            if one is not None and _whole(encoder, one):
                hi[i] = j
            else:
                lo[i] = j + 1
        pending = [i for i in pending if lo[i] < hi[i]]
    # lo ends on a candidate the bisection rendered: one found whole, or (none whole) the last, looked at last
    return {i: got[i, min(lo[i], len(later) - 1)] for i, later in starts.items()}


def _whole(encoder: Any, one: Rendered) -> bool:
    keep, full = encoder.kept(one[0], one[1][1])
    return keep > 0 and keep == full


def _render(encoder: Any, convs: List[Conversation]) -> List[Optional[Rendered]]:
    """Each conversation's segments and spans as the encoder renders and tokenizes them (None: refused)."""
    rendered, spans, _bad, _ = encoder.render_spans(convs)
    return [(segs, span) if segs and span is not None else None for segs, span in zip(rendered, spans)]
