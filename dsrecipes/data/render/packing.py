"""Packing (`data.packing=true`): encoded samples into rows of at most `cutoff_len` tokens.

Best-fit-decreasing over sample lengths (deterministic: ties keep input order); `position_ids` restart at 0 for each
sample, and the first label of every sample is -100 so no token is trained to predict across a sample boundary
(transformers keeps packed samples apart when `position_ids` restart, `attention_mask` is None and
`use_cache=False`).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Sequence

from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.tokenize import Example


@dataclass
class PackedRow:
    ids: List[str]
    input_ids: List[int]
    labels: List[int]
    position_ids: List[int]


def pack_plan(lengths: Sequence[int], cutoff_len: int) -> List[List[int]]:
    """Best-fit-decreasing: indices of samples per row, rows in creation order, samples in placement order.

    Longest first (ties in input order); each goes to the open row with the least room that still fits it, else
    a new row. Open rows are bucketed by free room, so a placement costs O(log cutoff_len).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: List[List[int]] = []
    rooms: List[int] = []  # sorted distinct free-room values that have open rows
    by_room: Dict[int, Deque[int]] = {}  # free room -> open rows with that room (oldest first)
    for i in order:
        length = lengths[i]
        if length > cutoff_len:
            raise ValueError(f"sample of {length} tokens exceeds cutoff_len={cutoff_len}")
        j = bisect.bisect_left(rooms, length)
        if j < len(rooms):
            room = rooms[j]
            bucket = by_room[room]
            row = bucket.popleft()
            if not bucket:
                del by_room[room]
                rooms.pop(j)
        else:
            room, row = cutoff_len, len(rows)
            rows.append([])
        rows[row].append(i)
        room -= length
        if room > 0:
            if room not in by_room:
                bisect.insort(rooms, room)
                by_room[room] = deque()
            by_room[room].append(row)
    return rows


def pack(examples: Sequence[Example], cutoff_len: int) -> List[PackedRow]:
    out = []
    for members in pack_plan([len(e.input_ids) for e in examples], cutoff_len):
        row = PackedRow([], [], [], [])
        for i in members:
            ex = examples[i]
            row.ids.append(ex.id)
            row.input_ids.extend(ex.input_ids)
            row.labels.extend([IGNORE_INDEX] + ex.labels[1:])
            row.position_ids.extend(range(len(ex.input_ids)))
        out.append(row)
    return out


def packing_efficiency(num_tokens: int, num_rows: int, cutoff_len: int) -> float:
    """Real tokens / token slots of the packed rows."""
    return num_tokens / (num_rows * cutoff_len) if num_rows else 0.0
