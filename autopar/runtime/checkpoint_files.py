"""The files of a training checkpoint (autopar/runtime/resume.py): listing them, their
sizes and crc32s, checking them against the manifest, and fsyncing a directory. Plain
file work: no process groups."""

from __future__ import annotations

import os
import zlib
from typing import Optional

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


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
