"""Does rank 0's shipped graph arrive intact? For each architecture's tiny config
(autopar/tools/sweep_configs.py): trace it, carry the program through torch.export's
serialiser as the other ranks receive it (passes/trace/program_bytes.py)
and compare the canonical fingerprints. One process, no ranks: this is the step where
a rank would otherwise fall back to tracing for itself (runtime/shipping.py).

    python bench/round_trip.py [--task causal-lm] [--training] [--limit 40] [--only a,b]

Prints one line per architecture that does not round-trip (or cannot be traced) and
the last line 'round trip: <same> of <traced> traced architectures (<skipped> not traced)'.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from autopar.passes.plan.planning import planning_inputs  # noqa: E402
from autopar.passes.trace.program_bytes import load_program, program_bytes  # noqa: E402
from autopar.passes.trace.trace import export_program, traced_program  # noqa: E402
from autopar.tools.sweep_configs import Task, Tiny, architectures  # noqa: E402


def round_trips(tiny: Tiny) -> tuple[str, str]:
    model, inputs = tiny.build()
    args, kwargs = planning_inputs(model, (), inputs)
    ep = export_program(model, args, kwargs)
    data = program_bytes(ep)
    here = traced_program(ep, model, args, kwargs).fingerprint
    there = traced_program(load_program(data), model, args, kwargs).fingerprint
    return here, there


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default=Task.CAUSAL_LM.value, choices=[t.value for t in Task])
    p.add_argument("--training", action="store_true")
    p.add_argument("--limit", type=int, default=None, help="the first N architectures, alphabetically")
    p.add_argument("--only", default="", help="comma-separated model types")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    task = Task(args.task)
    archs = architectures(task)
    names = sorted(args.only.split(",") if args.only else archs)[: args.limit]
    same = traced = 0
    for arch in names:
        try:
            here, there = round_trips(Tiny(arch, archs[arch], task, args.training))
        except Exception as e:  # noqa: BLE001 - an architecture that does not trace is counted apart
            print(f"{arch:28s} not traced: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
                  flush=True)
            continue
        traced += 1
        same += here == there
        if here != there:
            print(f"{arch:28s} DIFFERS: traced {here}, rebuilt {there}", flush=True)
    print(f"round trip: {same} of {traced} traced architectures ({len(names) - traced} not traced)")


if __name__ == "__main__":
    main()
