"""A data position that survives a change of world size.

    sampler = autopar.ElasticSampler(len(dataset), global_batch_size=32, seed=0)
    autopar.resume(pm, opt, root, data=sampler)        # restores the position, if any
    for indices in sampler:                            # the rest of this epoch's global batches
        batch = collate([dataset[i] for i in indices])  # the same rows on every rank
        ...
        autopar.save_training_checkpoint(pm, opt, root, step, data=sampler)

Each epoch's order is a permutation drawn from (seed, epoch) alone, and the position is
counted in global samples, so neither depends on how many ranks read it. autopar's inputs
are global: every rank is given the whole batch and the plan takes each rank's rows (with
`pm(**pm.shard_inputs(...), local_inputs=True)` a rank passes only its own), so a step
consumes `global_batch_size` samples on 2 ranks as on 4, and after a world change every
sample of the epoch is still seen exactly once, in the same batches.

The state (`state_dict()`) is what a training checkpoint records; `load_state_dict`
refuses a state of another dataset length, seed or order with a ValueError and changes
nothing then. A state of another global batch size is refused unless the sampler was made
with `rescale=True`: then the epoch continues at the same sample with the new batch size
(no sample is seen twice or skipped; the batches after the change are cut differently).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

_KEYS = ("num_samples", "global_batch_size", "seed", "shuffle", "drop_last", "epoch", "position")


class ElasticSampler:
    """Global batches of sample indices, resumable at any world size (module docstring)."""

    def __init__(self, num_samples: int, global_batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, rescale: bool = False) -> None:
        for name, value, least in (("num_samples", num_samples, 1), ("global_batch_size", global_batch_size, 1),
                                   ("seed", seed, 0)):
            if type(value) is not int or value < least:
                raise ValueError(f"ElasticSampler: {name}={value!r} must be an int >= {least}")
        if drop_last and global_batch_size > num_samples:
            raise ValueError(f"ElasticSampler: global_batch_size={global_batch_size} is larger than the "
                             f"{num_samples} samples, so drop_last=True leaves no batch; use a smaller batch")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.seed, self.shuffle, self.drop_last, self.rescale = seed, shuffle, drop_last, rescale
        self.epoch, self.position = 0, 0  # samples of this epoch already handed out
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its order), drawn once per epoch

    # ---- the order ------------------------------------------------------------------------
    def order(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s sample order: a permutation seeded by (seed, epoch) alone."""
        if self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = (epoch, torch.randperm(self.num_samples, generator=g).tolist())
            else:
                self._order = (epoch, list(range(self.num_samples)))
        return self._order[1]

    def batches_left(self) -> int:
        """Global batches of this epoch not yet handed out."""
        left = self.num_samples - self.position
        return left // self.global_batch_size if self.drop_last else -(-left // self.global_batch_size)

    def next_batch(self) -> list[int]:
        """The next global batch of this epoch (StopIteration when the epoch is done;
        set_epoch or iterating again starts the next one)."""
        if self.batches_left() == 0:
            raise StopIteration
        start = self.position
        self.position = min(start + self.global_batch_size, self.num_samples)
        return self.order(self.epoch)[start:self.position]

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of this epoch's global batches; an epoch already done moves on to the next."""
        if self.batches_left() == 0:
            self.set_epoch(self.epoch + 1)
        while self.batches_left():
            yield self.next_batch()

    def __len__(self) -> int:
        """Global batches left in this epoch (0 once it is done; iterating then starts the next)."""
        return self.batches_left()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its first sample; the epoch the sampler is in keeps its
        position, so the usual `for e in range(sampler.epoch, E): sampler.set_epoch(e)`
        loop continues a restored epoch where it stopped instead of repeating its start."""
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"ElasticSampler.set_epoch({epoch!r}): an int >= 0")
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    # ---- the state a checkpoint records ----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position; an epoch fully handed out is recorded as the next one's start, so a
        resumed `for e in range(sampler.epoch, E)` loop does not run a spent epoch again."""
        state = {k: getattr(self, k) for k in _KEYS}
        if self.batches_left() == 0:
            state.update(epoch=self.epoch + 1, position=0)
        return state

    def load_state_dict(self, state: Any) -> None:
        """Continue where `state` left off (checked whole before anything is set)."""
        problem = self.mismatch(state)
        if problem:
            raise ValueError(problem)
        self.epoch, self.position = state["epoch"], state["position"]

    def mismatch(self, state: Any) -> "str | None":
        """Why `state` cannot be continued by this sampler, or None."""
        if not isinstance(state, dict) or set(state) != set(_KEYS):
            return f"the data position {state!r} is not an ElasticSampler's state (keys {list(_KEYS)})"
        for key in ("num_samples", "seed", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                return (f"the data position was saved by a sampler with {key}={state[key]!r}, this one has "
                        f"{getattr(self, key)!r}: another order, so samples would be repeated or skipped; make the "
                        "sampler as the saving run did")
        if state["global_batch_size"] != self.global_batch_size and not self.rescale:
            return (f"the data position was saved with global_batch_size={state['global_batch_size']}, this sampler's "
                    f"is {self.global_batch_size}; keep the global batch (autopar's inputs are global, so it does not "
                    "change with the world size) or pass rescale=True to continue the epoch with the new one")
        if not (type(state["epoch"]) is int and type(state["position"]) is int and state["epoch"] >= 0
                and 0 <= state["position"] <= self.num_samples):
            return f"the data position epoch={state['epoch']!r}, position={state['position']!r} is out of range"
        return None

    def __repr__(self) -> str:
        return (f"ElasticSampler({self.num_samples} samples, global batch {self.global_batch_size}, "
                f"epoch {self.epoch}, position {self.position})")
