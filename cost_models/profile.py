"""Measured costs: a compute profile (op timings at local shapes) and a communication
calibration (alpha and beta per mesh axis and collective), kept in one JSON file.

    {"schema": "autopar.profile", "schema_version": 1, "device": "cpu", "torch_version": ..,
     "created": "2026-11-30T04:10:00Z", "cpu_contention": 4.0, "collective_sync_s": 0.006,
     "compute": {"<op>|<input shapes:dtypes>|<output shapes>": seconds, ...},
     "backward": {<the same keys>: seconds of the op's backward, ...},
     "program_factor": {"<graph fingerprint>|<mesh shape>|<train|infer>": 1.3, ...},
     "comm": {"<axis>:<collective>": {"alpha_s": .., "beta_s_per_byte": .., "residual": .., "ranks": n,
                                       "link": "intra" | "inter"}}}

Compute keys name the ATen op and its local shapes and dtypes; the device and torch
version are the file's. The planner looks timings up and falls back to the analytic
roofline for missing ones, counting how many it did.

A link fit holds for the axis it was measured on only while that axis's groups keep
their size and their kind (inside one node or across nodes): a profile calibrated on
one node is not applied to the inter-node axis of a two-node run; that axis is
calibrated again (fits written before the kind was stored count as intra-node).

This module prices only: the measuring (timing ops, calibrating links on live process
groups, measuring CPU contention) lives in autopar/runtime/measure.py, and the file in
autopar/core/files.py.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

import torch

from autopar.core.errors import PlanFileError
from autopar.core.kinds import StepKind
from autopar.core.placement import TensorMeta
from autopar.core.links import Link, LinkKind

SCHEMA, VERSION = "autopar.profile", 1
COLLECTIVES = tuple(k for k in StepKind if k.communicates)


def compute_key(target: Any, inputs: tuple[TensorMeta, ...], outputs: tuple[TensorMeta, ...]) -> str:
    fmt = lambda ms: ";".join(f"{'x'.join(map(str, m.shape))}:{str(m.dtype).removeprefix('torch.')}" for m in ms)  # noqa: E731
    return f"{target}|{fmt(inputs)}|{fmt(outputs)}"


@dataclass
class Profile:
    device: str
    torch_version: str = torch.__version__
    created: str = ""
    compute: dict[str, float] = field(default_factory=dict)
    # the same keys: seconds of the op's backward (autograd.grad of its floating outputs
    # with respect to its floating inputs); absent where it has none or could not replay
    backward: dict[str, float] = field(default_factory=dict)
    comm: dict[str, dict] = field(default_factory=dict)
    # ranks per core when run on a CPU host (timings are taken by one rank alone; at run
    # time that many ranks share each core); 1.0 on GPUs
    cpu_contention: float = 1.0
    # seconds a collective costs beyond its link's time when ranks arrive from compute:
    # ranks sharing cores reach it at different times and all wait for the last (measured
    # with the contention; None: not measured, as in files written before it existed)
    collective_sync_s: Optional[float] = None
    # per traced graph, mesh and mode: a planned rank program's measured time over the sum
    # of its ops' timings (program_key). Ops timed alone, on inputs they reuse, run faster
    # than inside a program, where each reads what the previous op just wrote and frees
    # memory the allocator must fault in again; small ops most (x1.45 for a 2-layer, 64-wide
    # GPT-2 forward on one CPU rank, x0.93 for a 512-wide one). Measured on the first plan
    # of a graph (runtime/measure.py: calibrate_program) and applied to every op of it
    program_factor: dict[str, float] = field(default_factory=dict)

    # ---- lookups the cost model makes --------------------------------------------
    def backward_s(self, target: Any, inputs: tuple, outputs: tuple) -> Optional[float]:
        return self.backward.get(compute_key(target, inputs, outputs))

    def compute_s(self, target: Any, inputs: tuple, outputs: tuple) -> Optional[float]:
        return self.compute.get(compute_key(target, inputs, outputs))

    def links(self, mesh_shape: tuple[int, ...],
              kinds: Optional[tuple[LinkKind, ...]] = None) -> dict[tuple[int, str], Link]:
        """Calibrated links per (axis, collective) that fit this mesh: the axis has the
        fit's size and, on `kinds` (Mesh.link_kinds; default all intra-node), its kind."""
        kinds = kinds or (LinkKind.INTRA,) * len(mesh_shape)
        out = {}
        for key, fit in self.comm.items():
            axis, kind = key.split(":")
            a = int(axis)
            if a < len(mesh_shape) and fit.get("ranks") == mesh_shape[a] and fit.get("link", "intra") == kinds[a].value:
                out[(a, kind)] = Link(fit["alpha_s"], fit["beta_s_per_byte"], f"measured {key} ({kinds[a].value}-node)")
        return out

    # ---- the stored form (files go through autopar/core/files.py, not here) ----------
    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "schema_version": VERSION, "device": self.device,
                "torch_version": self.torch_version,
                "created": self.created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "cpu_contention": self.cpu_contention, "collective_sync_s": self.collective_sync_s,
                "compute": self.compute, "backward": self.backward, "comm": self.comm,
                "program_factor": self.program_factor}

    @staticmethod
    def from_dict(d: Any, source: str = "<dict>") -> "Profile":
        if not isinstance(d, dict) or d.get("schema") != SCHEMA or d.get("schema_version") != VERSION:
            raise PlanFileError(f"{source} is not an autopar profile of schema version {VERSION}; "
                                "delete it to measure again")
        try:
            sync = d.get("collective_sync_s")
            return Profile(d["device"], d.get("torch_version", ""), d.get("created", ""), dict(d["compute"]),
                           dict(d.get("backward", {})), dict(d.get("comm", {})), float(d.get("cpu_contention", 1.0)),
                           None if sync is None else float(sync),
                           {str(k): float(v) for k, v in dict(d.get("program_factor", {})).items()})
        except (KeyError, TypeError, ValueError) as e:
            raise PlanFileError(f"{source} is a damaged autopar profile ({type(e).__name__}: {e}); "
                                "delete it to measure again") from e


def program_key(fingerprint: str, mesh_shape: tuple[int, ...], training: bool) -> str:
    """Profile.program_factor's key: a traced graph's fingerprint, the mesh, and the mode."""
    return f"{fingerprint}|{'x'.join(map(str, mesh_shape))}|{'train' if training else 'infer'}"


def program_factor_of(profile: "Profile", fingerprint: str, mesh_shape: tuple[int, ...],
                      training: bool) -> tuple[float, bool]:
    """(factor, measured for this graph): the profile's factor for this graph, mesh and
    mode; else the median of its factors for the mode on other graphs (a shipped profile
    was measured on one model: how much faster or slower ops run inside a program is
    mostly the device's dispatch, not the model's); else 1."""
    own = profile.program_factor.get(program_key(fingerprint, mesh_shape, training))
    if own is not None:
        return own, True
    mode = "train" if training else "infer"
    others = [v for k, v in profile.program_factor.items() if k.rsplit("|", 1)[-1] == mode]
    return (statistics.median(others), False) if others else (1.0, False)


# ---- fitting calibration timings --------------------------------------------------

RING = {  # collective -> (alpha steps, beta factor) on n ranks, as in cost_models/comm.py
    StepKind.ALL_REDUCE: (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    StepKind.ALL_GATHER: (lambda n: n - 1, lambda n: (n - 1) / n),
    StepKind.REDUCE_SCATTER: (lambda n: n - 1, lambda n: (n - 1) / n),
    StepKind.ALL_TO_ALL: (lambda n: n - 1, lambda n: (n - 1) / n),
}


def fit_alpha_beta(sizes: list[int], seconds: list[float], n: int, kind: StepKind) -> dict:
    """Least squares t = a + b * bytes in relative error (weights 1/t^2: the sizes span
    four orders of magnitude, and a plain fit would ignore the small messages), read as
    the ring model's alpha and beta; the residual is the relative RMS error of the fit."""
    m = len(sizes)
    w = [1.0 / (y * y) for y in seconds]
    sw, swx = sum(w), sum(wi * x for wi, x in zip(w, sizes))
    swxx = sum(wi * x * x for wi, x in zip(w, sizes))
    swy, swxy = sum(wi * y for wi, y in zip(w, seconds)), sum(wi * x * y for wi, x, y in zip(w, sizes, seconds))
    det = sw * swxx - swx * swx
    a = (swxx * swy - swx * swxy) / det
    b = (sw * swxy - swx * swy) / det
    if a <= 0 or b <= 0:  # keep the physics: a latency and a bandwidth term, both positive
        b = max(b, 1e-15)
        a = max(min(seconds) - b * sizes[seconds.index(min(seconds))], 1e-7)
    pred = [a + b * x for x in sizes]
    residual = (sum(((p - y) / y) ** 2 for p, y in zip(pred, seconds)) / m) ** 0.5
    steps, factor = RING[kind]
    return {"alpha_s": a / steps(n), "beta_s_per_byte": b / factor(n), "residual": residual, "ranks": n}
