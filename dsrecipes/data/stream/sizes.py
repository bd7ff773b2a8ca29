"""How a `data=iterable` stream is cut: the block (the unit a reader reads and the index records) and the chunk
(a run of adjacent blocks of one file that the epoch order keeps together, stream/order.py).

Blocks: automatic size = the stream's bytes / `BLOCKS_PER_STREAM` (objects in a store: / `BLOCKS_PER_REMOTE_STREAM`,
fewer, larger blocks, one GET each when scattered), a power of two within [4 KiB, 1 MiB].

Chunks: the order permutes chunks, not blocks, so a reader's stretch holds runs of adjacent blocks that one ranged
GET serves (data/sources/remote_ahead.py merges touching blocks up to `data.span_bytes`). Objects in a store:
automatic size = the stream's bytes / `CHUNKS_PER_REMOTE_STREAM`, rounded up to a power of two, within one block and
`MAX_AUTO_CHUNK` (not tied to `data.span_bytes`, which may change on resume while the order must not: a chunk over
the span is two GETs). Local files: one block per chunk (a pread per block costs no round trip, so the
order keeps its finest grain). The price of a chunk: samples that are near each other in a file stay nearer each
other in the epoch (see "How random" in stream/order.py).
"""

from __future__ import annotations

from typing import Optional

BLOCKS_PER_STREAM = 1 << 16  # automatic block size: the stream's bytes / this, within [4 KiB, 1 MiB]
BLOCKS_PER_REMOTE_STREAM = 1 << 12  # objects in a store: fewer, larger blocks (one GET each; latency-bound)
CHUNKS_PER_REMOTE_STREAM = 1 << 7  # objects in a store: automatic chunk size = the stream's bytes / this
MAX_AUTO_CHUNK = 1 << 20  # ... at most this (the default data.span_bytes, 8 MiB, serves it in one GET)


def auto_block_bytes(total_bytes: int, remote: bool = False) -> int:
    per = BLOCKS_PER_REMOTE_STREAM if remote else BLOCKS_PER_STREAM
    return int(min(1 << 20, max(1 << 12, 1 << max(0, int(total_bytes // per).bit_length()))))


def auto_chunk_bytes(total_bytes: int, block_bytes: int, remote: bool) -> int:
    """The automatic `data.chunk_bytes`: one block for local files; objects in a store: see the module docstring."""
    if not remote:
        return int(block_bytes)
    want = 1 << (max(1, int(total_bytes) // CHUNKS_PER_REMOTE_STREAM) - 1).bit_length()  # up to a power of two
    return int(max(block_bytes, min(want, MAX_AUTO_CHUNK)))


def chunk_bytes_of(chosen: Optional[int], total_bytes: int, block_bytes: int, remote: bool) -> int:
    """`data.chunk_bytes` as set, or the automatic size when null."""
    return int(chosen) if chosen is not None else auto_chunk_bytes(total_bytes, block_bytes, remote)


def blocks_per_chunk(chunk_bytes: int, block_bytes: int) -> int:
    """Blocks of a chunk: chunk_bytes // block_bytes, at least one."""
    return max(1, int(chunk_bytes) // max(1, int(block_bytes)))
