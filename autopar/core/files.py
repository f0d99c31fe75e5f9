"""JSON files that are never half-written and never silently misread.

Plans (autopar/core/plan_io.py) and cost profiles are both saved through these two
functions: a write goes to a temporary file beside the target and is renamed over it,
so a reader sees the old file or the new one; a read names the file and what is wrong
with it (missing, truncated, not JSON) in a PlanFileError.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from typing import Any

from autopar.core.errors import PlanFileError


def write_json_atomic(path: "str | os.PathLike", data: Any) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees half a file."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".autopar-", suffix=".json.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            _as_open_makes_it(f.fileno())
            json.dump(data, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _as_open_makes_it(fd: int) -> None:
    """The modes open() would give a new file (0666 less the umask), not mkstemp's 0600,
    which would hide a plan from the group. The umask is read from /proc where it can
    be (setting it to read it back races with other threads creating files)."""
    if not hasattr(os, "fchmod"):  # no POSIX modes on this platform: the file keeps mkstemp's
        return
    try:
        os.fchmod(fd, 0o666 & ~_umask())
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):  # only "this file system has no modes"
            raise


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def read_json(path: "str | os.PathLike", what: str, remedy: str) -> Any:
    """The parsed contents of `path`; `what` ("plan file", "profile") and `remedy` (how to
    make a good one) go into the error when it is missing or damaged."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise PlanFileError(f"{what} {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanFileError(f"{what} {path} is corrupt or truncated ({e}); {remedy}") from None
