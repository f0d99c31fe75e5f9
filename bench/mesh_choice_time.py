"""How long mesh="auto" takes to choose: the Llama-3-8B shape (training, batch 8 x 512, h100
preset, fp32, on the meta device: no weights) planned over every 1-, 2- and 3-axis mesh of
N devices, one node. Each candidate's line (plan.explain_mesh()): its predicted step and
memory, and where the solver did not prove it the mesh's best, the lower bound it proved;
last lines: the mesh chosen, the total seconds and the process's peak memory.

    python bench/mesh_choice_time.py [--devices 8] [--time-limit-s 120]

Three-axis candidates start from the cheapest plan of their merged two-axis meshes
(passes/solve/warm_start.py); that is why the two-axis ones come first.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import autopar  # noqa: E402
from autopar.tools.zoo import build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--time-limit-s", type=float, default=120.0, help="Options.time_limit_s of each candidate")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    model, inputs, kwargs = build("llama3-8b", device="meta", batch=8, seq=512, training=True)
    t0 = time.perf_counter()
    plan = autopar.plan(model, inputs, kwargs, mesh="auto", devices=args.devices, device="h100",
                        time_limit_s=args.time_limit_s)
    seconds = time.perf_counter() - t0
    print(plan.explain_mesh())
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"Llama-3-8B shape on {args.devices} devices: chose {plan.mesh.shape} at {plan.total_s * 1e3:.2f} ms "
          f"predicted, of {len(plan.mesh_candidates)} candidates")
    print(f"mesh='auto' took {seconds:.1f} s, peak memory {peak_gib:.1f} GiB")


if __name__ == "__main__":
    main()
