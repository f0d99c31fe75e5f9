"""Run in a process of its own, with the PYTHONHASHSEED its parent chose: plan tiny
models offline and print their fingerprints and digests (saving each plan when asked),
or be one of two gloo ranks that compile a model from a saved plan file and compare it
with one device.

    python -m tests.seeded_process plan OUT.json [PLAN_DIR]
    python -m tests.seeded_process run RANK STORE PLAN_DIR OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta

import torch

# transformers families whose graph is built iterating a set of layer types
ARCHITECTURES = (("gemma3_text", "Gemma3ForCausalLM", "causal-lm"), ("modernbert", "ModernBertForMaskedLM", "masked-lm"))


def _build(arch: str, model_class: str, task: str):
    from autopar.tools.sweep_configs import Task, Tiny
    return Tiny(arch, model_class, Task(task), training=False).build()


def plan(out: str, plan_dir: str = "") -> None:
    import autopar
    found = {}
    for arch, model_class, task in ARCHITECTURES:
        model, inputs = _build(arch, model_class, task)
        p = autopar.plan(model, (), inputs, mesh=(2,))
        found[arch] = {"fingerprint": p.fingerprint, "digest": p.digest()}
        if plan_dir:
            p.to_json(os.path.join(plan_dir, f"{arch}.json"))
    json.dump(found, open(out, "w"))


def run(rank: int, store: str, plan_dir: str, out: str) -> None:
    import torch.distributed as dist
    import autopar
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    found = {}
    for arch, model_class, task in ARCHITECTURES:
        model, inputs = _build(arch, model_class, task)
        pm = autopar.compile(model, (), inputs, mesh=(2,), plan=os.path.join(plan_dir, f"{arch}.json"))
        with torch.no_grad():
            got, want = pm(**inputs).logits, model(**inputs).logits
        found[arch] = {"close": bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5)), "solves": pm.solve_count}
    json.dump(found, open(out, "w"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.argv[1] == "plan":
        plan(*sys.argv[2:])
    else:
        run(int(sys.argv[2]), *sys.argv[3:])
