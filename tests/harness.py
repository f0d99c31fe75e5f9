"""Spawn real gloo ranks, run named cases in each, collect what every rank returns.

Ranks start from a fork server that has imported torch, transformers and autopar once
per test session (START_METHOD), so a rank does not pay those imports again; the server
itself never runs a torch op, so no thread pool or process group is forked. Each spawn
still costs a second or two, so a test batches many cases into one spawn
(AUTOPAR_TEST_CASE_TIMES=1 prints each case's seconds on rank 0). A case is a module-level function `case(rank, world, **kw) -> dict`
that builds its model from a fixed seed and returns tensors; the parent compares."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar import _compat

START_METHOD = "forkserver"
# what the fork server imports before it forks any rank (a failing import is skipped).
# Besides the packages: what every rank's first trace and first model would import
# lazily (torch.export's tracer, networkx through the partitioner, transformers' masks
# and the families the cases build), about 0.8 s of CPU per rank that every spawn paid
# again; none of them starts a thread
PRELOAD = ["torch", "torch.distributed", "transformers", "autopar.api", "tests.cases",
           "torch.export._trace", "networkx", "transformers.masking_utils",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
           "transformers.models.bert.modeling_bert", "transformers.models.mistral.modeling_mistral"]
SPAWN_TIMEOUT_S = float(os.environ.get("AUTOPAR_TEST_TIMEOUT_S", "600"))
COLLECTIVE_TIMEOUT_S = 120


def _worker(rank: int, world: int, store_path: str, out_dir: str, cases: list[tuple[Callable, dict]]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _compat.report_fatal_signals()  # a rank killed by a signal prints where every thread was, native frames too
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    results: list[Any] = []
    try:
        for fn, kw in cases:
            started = time.perf_counter()
            try:
                results.append(fn(rank, world, **kw))
            except Exception:  # noqa: BLE001 - reported to the parent test with the traceback
                results.append({"error": traceback.format_exc()})
                break
            if rank == 0 and os.environ.get("AUTOPAR_TEST_CASE_TIMES"):  # where a spawn's minutes go
                print(f"{time.perf_counter() - started:7.2f} s  {fn.__name__} {kw}", file=sys.stderr, flush=True)
            unwaited = unwaited_collectives()
            if unwaited:  # its output may be freed while gloo still writes it
                results.append({"error": f"{fn.__name__} left {unwaited} collectives launched and never waited"})
                break
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        # every rank leaves together: a rank tearing down gloo while a peer still has
        # work in flight on the same pair can abort the peer ("terminate called ...")
        if not any(isinstance(r, dict) and "error" in r for r in results):
            dist.barrier()
        dist.destroy_process_group()
    # the results are on disk and the group is gone: end here, without the interpreter's
    # teardown (gloo threads, groups cached by modules, atexit hooks), which no test checks
    # and which can only add a late crash to a rank whose work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def unwaited_collectives() -> int:
    """Functional collectives this rank launched and never waited on (torch's work
    registry; 0 where this torch does not expose it)."""
    size = getattr(torch._C._distributed_c10d, "_get_work_registry_size", None)
    return size() if size is not None else 0


def run_ranks(world: int, cases: list[tuple[Callable, dict]]) -> list[list[Any]]:
    """Run `cases` on `world` gloo ranks; returns results[rank][case]. Raises with the
    first rank's traceback if any case failed there."""
    # the fork server imports numpy (through torch), whose OpenBLAS starts a thread pool:
    # one thread, so the server forks ranks from a single-threaded process
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    mp.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_worker, args=(world, store, tmp, cases), nprocs=world, join=False,
                                 start_method=START_METHOD)
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} ranks did not finish within {SPAWN_TIMEOUT_S} s")
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        for item in res:
            if isinstance(item, dict) and isinstance(item.get("error"), str):
                raise AssertionError(f"rank {r} failed:\n{item['error']}")
    return results


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plain_env(**extra: str) -> dict:
    """This environment for a plain process that imports the repository's packages."""
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path, **extra}


def run_processes(commands: list[list[str]], envs: list[dict], timeout_s: float = 600) -> list[tuple[int, str]]:
    """Each command started at once as a plain process (its own interpreter, environment
    and exit code, as torchrun starts a rank) in the repository root; the (exit code,
    output) of each. Past `timeout_s` every process is killed and TimeoutError raised."""
    import subprocess
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in zip(commands, envs)]
    deadline = time.monotonic() + timeout_s
    try:
        logs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{len(procs)} processes did not finish within {timeout_s} s") from None
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, log) for p, log in zip(procs, logs)]
