"""What every strategy's train loader shares: the rank's position in the plan, epochs, and the resume state.

A strategy only says how to produce the remaining micro-batches of an epoch from an `EpochPlan`-like position
(`_batches`); counting, epochs, `state_dict` and elastic resume live here once.
"""

from __future__ import annotations

import signal
from typing import Any, Dict, Iterator, Optional

from dsrecipes.core.errors import DataError
from dsrecipes.data.plan import STATE_VERSION, Layout, Position, resume_point

Batch = Dict[str, Any]
Row = Dict[str, Any]


def loader_generator(seed: int, epoch: int) -> Any:
    """The DataLoader's own generator: creating a DataLoader iterator draws a seed from the global torch RNG unless
    it has one, which would shift dropout after a resume (the resumed run creates an iterator the original did not
    create at that point). With its own generator the training RNG is left exactly as the checkpoint restored it."""
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def worker_ignores_stop_signals(_worker_id: int) -> None:
    """DataLoader `worker_init_fn`: a SIGTERM/SIGINT sent to the whole process group must stop the rank at a step
    boundary (stopping.py), not kill the worker that feeds it mid-step; workers end with their rank."""

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class TrainLoader:
    """Collated micro-batches of one rank. Iterating yields the rest of the current epoch from where it stands.

    Runner protocol::

        loader.load_state_dict(state)                  # when resuming (else it starts at epoch 0)
        for epoch in itertools.count(loader.epoch):    # or range(loader.epoch, cfg.trainer.epochs)
            loader.set_epoch(epoch)                    # same epoch as the loaded state: keeps the position
            for batch in loader: ...                   # the epoch's remaining micro-batches, equal on all ranks
        json.dump(loader.state_dict(), ...)            # after an optimizer step, per rank

    A loader whose `steps_per_epoch` is None would be an endless stream (iterating moves to the next epoch by
    itself); the built-in strategies all know their epoch length (iterable: counted by its index). Every batch
    carries `epoch` for the ledger.
    """

    kind: str = ""

    def __init__(
        self,
        layout: Layout,
        rank: int,
        seed: int,
        shuffle: bool,
        fingerprint: Dict[str, Any],
        global_rank: Optional[int] = None,
    ):
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"rank {rank} outside world size {layout.world_size}")
        self.layout = layout  # the layout positions are planned in (presharded: a world of one over the own part)
        self.rank = rank  # the rank inside that layout
        self.global_rank = rank if global_rank is None else global_rank
        self.seed = seed
        self.shuffle = shuffle
        self.fingerprint = dict(fingerprint, kind=self.kind, seed=seed, shuffle=shuffle)
        self.epoch = 0
        self._offset = 0  # global position where the current epoch plan starts (nonzero after an elastic resume)
        self._micro = 0  # micro-batches of this plan consumed by the caller
        self._start_micro = 0  # where the next iteration starts inside the plan

    # -- what a strategy provides ------------------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> Optional[int]:
        raise NotImplementedError

    def _batches(self, offset: int, start_micro: int) -> Iterator[Batch]:
        """The remaining micro-batches of epoch `self.epoch` for a plan at `offset`, from micro `start_micro`."""
        raise NotImplementedError

    @property
    def endless(self) -> bool:
        return self.steps_per_epoch is None

    # -- shared ------------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning, unless the loader already stands in it (e.g. after a resume)."""
        if epoch != self.epoch:
            self.epoch, self._offset, self._micro, self._start_micro = epoch, 0, 0, 0

    def __iter__(self) -> Iterator[Batch]:
        while True:
            self._start_micro = self._micro
            for batch in self._batches(self._offset, self._micro):
                self._micro += 1
                batch["epoch"] = self.epoch
                yield batch
            if not self.endless:
                return
            self.epoch, self._offset, self._micro, self._start_micro = self.epoch + 1, 0, 0, 0

    def position(self) -> Position:
        lay = self.layout
        return Position(self.epoch, self._offset, self._micro, lay.world_size, lay.micro_batch_size, lay.grad_accum)

    def state_dict(self) -> Dict[str, Any]:
        pos = self.position()
        return {
            "version": STATE_VERSION,
            "rank": self.global_rank,
            "position": pos.to_dict(),
            "samples_consumed": pos.samples_consumed,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data state version {state.get('version')!r} is not {STATE_VERSION}; cannot resume")
        self.check_fingerprint(state)
        saved = Position(**state["position"])
        try:
            self.epoch, self._offset, self._micro = resume_point(saved, self.layout)
        except ValueError as exc:
            raise DataError(str(exc)) from None
        self._start_micro = self._micro

    def check_fingerprint(self, state: Dict[str, Any]) -> None:
        changed = [
            f"{k}: {state['fingerprint'].get(k)!r} -> {v!r}"
            for k, v in self.fingerprint.items()
            if state["fingerprint"].get(k) != v
        ]
        if changed:
            raise DataError(
                "cannot resume the data position exactly: the data setup changed since the checkpoint ("
                + "; ".join(changed)
                + "). Resume with the original settings, or start a fresh run (trainer.resume=never)"
            )

