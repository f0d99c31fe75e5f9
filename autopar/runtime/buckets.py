"""Bucketed gradient all-reduce for data-parallel parameters.

The rewrite leaves out grad_sync steps that sit directly on a parameter whose every use
syncs over the same mesh axes (passes/rewrite.py: deferred_grad_syncs). Instead, each
such parameter marks itself when autograd has accumulated its gradient, and one callback
at the end of the backward pass all-reduces all of them over their axes, flattened
into buckets of at most BUCKET_BYTES, as DistributedDataParallel does. Only this
backward's part of .grad is reduced (a gradient accumulated from earlier backwards was
reduced then), so gradient accumulation stays correct.
"""

from __future__ import annotations

from typing import Optional

import torch

from autopar import _compat
from autopar.runtime.collectives import AxisComm, _all_reduce

BUCKET_BYTES = 25 * 2**20


class GradBuckets:
    def __init__(self, params: list[tuple[str, torch.nn.Parameter, tuple[int, ...]]],
                 comms: tuple[AxisComm, ...]) -> None:
        self.params = params  # (name, parameter, axes), in a fixed order on every rank
        self.comms = comms
        self.by_id = {id(p): name for name, p, _ in params}  # tied names share one tensor
        self.before: dict[str, Optional[torch.Tensor]] = {}
        self.ready: set[str] = set()
        self.queued = False

    def arm(self) -> None:
        """Called before each forward: remember what .grad held (None after zero_grad)."""
        self.before = {name: (p.grad.detach().clone() if p.grad is not None else None) for name, p, _ in self.params}
        self.ready.clear()
        self.queued = False

    def accumulated(self, param: torch.nn.Parameter) -> None:
        """The runtime's post-accumulate-grad hook on every parameter calls this."""
        name = self.by_id.get(id(param))
        if name is None:
            return
        self.ready.add(name)
        if not self.queued:
            self.queued = True
            _compat.queue_backward_callback(self.flush)

    @torch.no_grad()
    def flush(self) -> None:
        by_axes: dict[tuple[int, ...], list[tuple[str, torch.nn.Parameter]]] = {}
        for name, p, axes in self.params:
            if name in self.ready and p.grad is not None:
                by_axes.setdefault(axes, []).append((name, p))
        for axes, members in by_axes.items():
            bucket: list[tuple[str, torch.nn.Parameter]] = []
            size = 0
            for name, p in members:
                bucket.append((name, p))
                size += p.grad.numel() * p.grad.element_size()
                if size >= BUCKET_BYTES:
                    self._reduce(bucket, axes)
                    bucket, size = [], 0
            if bucket:
                self._reduce(bucket, axes)
        self.ready.clear()
        self.queued = False

    def _reduce(self, bucket: list[tuple[str, torch.nn.Parameter]], axes: tuple[int, ...]) -> None:
        new = [p.grad - self.before[name] if self.before.get(name) is not None else p.grad for name, p in bucket]
        flat = torch.cat([g.reshape(-1) for g in new])
        for a in axes:
            flat = _all_reduce(flat, self.comms[a])
        offset = 0
        for (name, p), g in zip(bucket, new):
            part = flat[offset: offset + g.numel()].view_as(g)
            offset += g.numel()
            base = self.before.get(name)
            p.grad.copy_(part if base is None else base + part)
