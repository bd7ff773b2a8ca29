"""mosaicml-streaming's side of benchmarks/bench_store.py (not a benchmark itself): its MDS shards, its launch and
its readers, each started as a streaming user starts them (`StreamingDataset(remote, local, batch_size, shuffle)`).

Owner: benchmarks/. Imported only where `import_streaming()` works (mosaicml-streaming is not a dsrecipes
dependency). `PREDOWNLOAD[0]` is bench_store's --st-predownload (None: streaming's default, 8 x batch_size),
`SHUFFLE_BLOCK[0]` its --st-shuffle-block (None: streaming's default, max(4M / canonical nodes, 262144) samples).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from contextlib import contextmanager
from pathlib import Path


def upload_mds(fs, paths: list, shard_mb: float, tmp: Path) -> dict:
    from streaming import MDSWriter

    t0, mds = time.perf_counter(), tmp / "mds"
    with MDSWriter(out=str(mds), columns={"text": "str"}, size_limit=int(shard_mb * (1 << 20))) as writer:
        for path in paths:
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    writer.write({"text": line.rstrip("\n")})
    convert_s = time.perf_counter() - t0
    for p in sorted(mds.iterdir()):
        fs.put_file(str(p), f"s3://bench/mds/{p.name}")
    shutil.rmtree(mds)
    return {"mds_convert_s": round(convert_s, 2), "mds_files": len(fs.ls("s3://bench/mds"))}


def import_streaming():
    for name in ("streaming.vision", "streaming.multimodal"):  # their torchvision imports are not needed here
        sys.modules.setdefault(name, types.ModuleType(name))
    import streaming

    return streaming


PREDOWNLOAD = [None]  # --st-predownload (None: streaming's default, 8 x batch_size)
SHUFFLE_BLOCK = [None]  # --st-shuffle-block (None: streaming's default)


def st_dataset(local: Path, batch: int):
    from streaming import StreamingDataset

    return StreamingDataset(remote="s3://bench/mds", local=str(local), batch_size=batch, shuffle=True, shuffle_seed=0,
                            predownload=PREDOWNLOAD[0], shuffle_block_size=SHUFFLE_BLOCK[0])


def st_launch(proxy, tmp: Path, batch: int) -> dict:
    from streaming.base.util import clean_stale_shared_memory

    local = Path(tempfile.mkdtemp(dir=tmp))
    b0, t0 = proxy.body_bytes, time.perf_counter()
    ds = st_dataset(local, batch)
    out = (proxy.body_bytes - b0, time.perf_counter() - t0)
    del ds
    clean_stale_shared_memory()
    return {"launch": {"cold": out}}


def st_readers(readers: int, proxy, tmp: Path, batch: int) -> dict:
    """Every node of R (1 rank, 1 worker each), one after another in this process, like the dsrecipes readers:
    node r is `RANK=r WORLD_SIZE=R LOCAL_RANK=0 LOCAL_WORLD_SIZE=1`, each with its own local cache directory.
    streaming would start a torch process group for WORLD_SIZE > 1 only to pass a barrier at the end of
    `StreamingDataset.__init__` (no data crosses it; each node plans its own samples from the index and the world),
    so `maybe_init_dist` is switched off for the run (`no_process_group`)."""
    from streaming.base.util import clean_stale_shared_memory

    b0, r0, firsts, rates = proxy.body_bytes, proxy.requests, [], []
    with no_process_group():
        for node in range(readers):
            os.environ.update(RANK=str(node), WORLD_SIZE=str(readers), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            local = Path(tempfile.mkdtemp(dir=tmp))
            t0, n, first = time.perf_counter(), 0, None
            ds = st_dataset(local, batch)  # timed like a dsrecipes reader: from nothing in memory (its index.json GET)
            for sample in ds:  # to `batch` decoded rows: json.loads of the `text` column
                json.loads(sample["text"])
                n += 1
                if first is None and n == batch:
                    first = time.perf_counter() - t0
            rates.append(n / (time.perf_counter() - t0))
            firsts.append(first)
            del ds
            clean_stale_shared_memory()
            shutil.rmtree(local, ignore_errors=True)
    return {"bytes": proxy.body_bytes - b0, "gets": proxy.requests - r0, "first_batch_s": statistics.median(firsts),
            "first_batch_s_range": [min(firsts), max(firsts)], "samples_s": statistics.median(rates)}


@contextmanager
def no_process_group():
    import streaming.base.dataset as st_dataset_module
    import streaming.base.util as st_util

    saved = st_dataset_module.maybe_init_dist, st_util.maybe_init_dist, dict(os.environ)
    st_dataset_module.maybe_init_dist = st_util.maybe_init_dist = lambda: False
    try:
        yield
    finally:
        st_dataset_module.maybe_init_dist, st_util.maybe_init_dist = saved[0], saved[1]
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(key, None)
        os.environ.update(saved[2])
