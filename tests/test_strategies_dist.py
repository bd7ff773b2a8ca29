"""Two real processes with a gloo process group (no model): each rank runs its own loader of every strategy with
DataLoader workers, writes the sample ledger like the runner does, and the ranks all-reduce their step counts.
The parent then checks disjointness, equal steps and coverage from the ledgers (`verify_ledgers`)."""

from __future__ import annotations

import pytest

from dsrecipes.core.distributed import free_port

pytestmark = pytest.mark.slow

WORLD = 2
MBS, ACCUM = 2, 2


def _rank_main(rank: int, port: int, root: str, paths: list, n_map: int) -> None:
    import torch
    import torch.distributed as dist

    from dsrecipes.data.plan.ledger import LedgerWriter
    from tests.test_strategies import make_map, make_presharded, make_stream

    torch.multiprocessing.set_start_method("fork", force=True)  # as in a launcher-started rank (spawn is slow here)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    loaders = {
        "map": make_map(n_map, WORLD, rank, 2, MBS, ACCUM),
        "iterable": make_stream(paths, WORLD, rank, 2, MBS, ACCUM, num_samples=None),  # endless: step budget
        "presharded": make_presharded(paths[:WORLD], WORLD, rank, 2, MBS, ACCUM),
    }
    for name, loader in loaders.items():
        ledger = LedgerWriter(f"{root}/{name}", rank)
        micro = 0
        for epoch in range(2):
            loader.set_epoch(epoch)
            for batch in loader:
                ledger.record(batch["epoch"], micro // ACCUM + 1, batch["ids"])
                micro += 1
                if loader.endless and micro == 2 * 5 * ACCUM:  # two epochs of 5 steps (44 lines // 8)
                    break
            if loader.endless:
                break
        ledger.close()
        counts = torch.tensor([micro, -micro])
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        assert counts[0] == -counts[1] == micro, f"{name}: ranks ran different micro-batch counts"
    dist.destroy_process_group()


def test_two_process_loaders_disjoint_and_equal(tmp_path):
    import torch.multiprocessing as mp

    from dsrecipes.data.plan.ledger import verify_ledgers
    from tests.test_strategies import all_ids, write_files

    paths = write_files(tmp_path, [21, 23])
    mp.start_processes(_rank_main, args=(free_port(), str(tmp_path), paths, 50), nprocs=WORLD, join=True, start_method="spawn")
    gb = WORLD * MBS * ACCUM
    expected = {
        "map": [f"s{i}" for i in range(50)],
        "iterable": sorted(all_ids(paths)),
        "presharded": None,
    }
    for name, ids in expected.items():
        rep = verify_ledgers(tmp_path / name, expected_ids=ids, global_batch=gb, complete_epochs=[0, 1])
        assert rep.ok, f"{name}:\n{rep.summary()}"
        assert rep.epochs == [0, 1]
        assert len(set(rep.steps_per_rank.values())) == 1
    rep = verify_ledgers(tmp_path / "presharded")
    # presharded ids are rank:line of each rank's own part, so disjoint by construction; steps from the smaller part
    assert rep.ok and rep.steps_per_rank == {0: 2 * (21 // 4), 1: 2 * (21 // 4)}
