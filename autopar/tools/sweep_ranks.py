"""The sweep's --ranks stage: a plan on prod(mesh) spawned gloo ranks, each rebuilding
the same tiny model (sweep_configs.Tiny, fixed seed) and running autopar.verify against
its own single-device copy. Each rank writes one report file; the first that is not OK
is returned."""

from __future__ import annotations

import os
import tempfile
import traceback
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.tools.sweep_configs import Tiny
from autopar.tools.verify import verify


def run_on_ranks(plan, tiny: Tiny) -> Optional[tuple[int, str, str]]:
    """None when every rank matched one device, else (rank, "MISMATCH" or "ERROR", report)
    of the first rank that did not. The caller's time limit ends a hang (the sweep's
    worker kills its process group, these ranks with it)."""
    world = plan.mesh.size
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        plan.to_json(plan_path)
        ctx = mp.start_processes(_rank_main, args=(world, tmp, tiny, plan.mesh.shape, plan_path),
                                 nprocs=world, join=False, start_method="spawn")
        while not ctx.join(timeout=5):
            pass
        reports = [open(os.path.join(tmp, f"rank{r}.txt")).read() for r in range(world)]
    for rank, text in enumerate(reports):
        if not text.startswith("OK"):
            return rank, "MISMATCH" if text.startswith("MISMATCH") else "ERROR", text
    return None


def _rank_main(rank: int, world: int, tmp: str, tiny: Tiny, mesh: tuple[int, ...], plan_path: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    text = "ERROR"
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        model, kwargs = tiny.build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = verify(model, (), kwargs, mesh=mesh, plan=plan_path)
        text = f"{'OK' if report.ok else 'MISMATCH'} {report}"
    except Exception:  # noqa: BLE001 - reported to the sweep
        text = f"ERROR {traceback.format_exc()[-600:]}"
    finally:
        with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
            f.write(text)
        if dist.is_initialized():
            dist.destroy_process_group()
