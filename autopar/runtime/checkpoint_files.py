"""The files of a training checkpoint (autopar/runtime/resume.py): the manifest, finding
complete checkpoints, listing files with their sizes and crc32s, checking them against
the manifest, and fsyncing a directory. Plain file work: no process groups."""

from __future__ import annotations

import hashlib
import os
import re
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from autopar.core.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = 1
_COMPLETE = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CheckpointManifest:
    """The completion marker of a checkpoint and what a load checks against."""

    step: int  # steps done when it was saved: the data position to resume at
    world_size: int
    mesh: tuple[int, ...]
    model_digest: str  # state-dict names, global shapes, dtypes
    layout_digest: str  # their placements (informational: DCP reshards on load)
    plan_digest: str  # the current plan's digest at save time ("" if none)
    files: tuple[tuple[str, int, int], ...]  # (path inside the directory, bytes, crc32)
    extra: dict = field(default_factory=dict)  # the caller's JSON values (e.g. a sampler's state)
    param_groups: Optional[tuple] = None  # the optimiser's parameter names per group; None: saved without one
    # (pipelined: one such tuple per rank, each rank's optimiser holding its own stages' parameters)
    pipeline: Optional[dict] = None  # a pipelined model's split (pipeline_state.pipeline_layout); None: not pipelined
    data: Optional[dict] = None  # the data position's state (e.g. an ElasticSampler's); None: none was saved
    torch_version: str = torch.__version__
    format: int = FORMAT

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: Any, path: str) -> "CheckpointManifest":
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, this autopar reads {FORMAT}")
            groups = data.get("param_groups")
            return CheckpointManifest(**{**data, "mesh": tuple(data["mesh"]),
                                         "files": tuple((str(f), int(n), int(c)) for f, n, c in data["files"]),
                                         "param_groups": None if groups is None else tuple(map(tuple, groups))})
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint manifest {path} is not one autopar wrote ({e}); resume from another "
                                  "checkpoint", path) from None


# ---- discovery --------------------------------------------------------------------------
def checkpoint_dir(root: "str | os.PathLike", step: int) -> str:
    return os.path.join(os.fspath(root), f"step-{step:08d}")


def complete_checkpoints(root: "str | os.PathLike") -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under root, oldest first: named
    `step-N` (renamed, so finished) and holding a manifest. Temp directories are skipped."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _COMPLETE.match(name)
        if m and os.path.isfile(os.path.join(root, name, MANIFEST)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_checkpoint(root: "str | os.PathLike") -> Optional[str]:
    """The newest complete checkpoint under root, or None (a fresh start)."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def verify_files(path: str, files: tuple) -> Optional[str]:
    for name, size, crc in files:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"checkpoint {path} is missing its file {name}; it is damaged: resume from another checkpoint"
        try:
            fact = file_fact(path, name)
        except OSError as e:
            return f"checkpoint {path}: {name} cannot be read ({e}); resume from another checkpoint"
        if fact[1] != size:
            return (f"checkpoint {path}: {name} has {fact[1]} bytes, the manifest says {size} (truncated or "
                    "overwritten); it is damaged: resume from another checkpoint")
        if fact[2] != crc:
            return (f"checkpoint {path}: {name} fails its crc32 check (its bytes changed after the save); it is "
                    "damaged: resume from another checkpoint")
    return None


def list_files(folder: str) -> list[str]:
    out = []
    for here, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(here, n), folder) for n in names]
    return sorted(n for n in out if n != MANIFEST)


def file_facts(folder: str, names: list[str]) -> "list[tuple[str, int, int]] | str":
    """(name, bytes, crc32) of each file, or what went wrong reading them."""
    try:
        return [file_fact(folder, n) for n in names]
    except OSError as e:
        return f"checksumming the new checkpoint {folder} failed ({e}); it stays incomplete and is ignored"


def file_fact(folder: str, name: str) -> tuple[str, int, int]:
    crc, size = 0, 0
    with open(os.path.join(folder, name), "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return name, size, crc


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def digest(items: Any) -> str:
    """A short hash of a sequence of plain values (what a manifest's digests compare)."""
    return hashlib.sha256(repr(list(items)).encode()).hexdigest()[:16]
