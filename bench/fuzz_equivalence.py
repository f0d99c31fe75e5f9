"""Fuzzed equivalence at a larger budget than CI: random models and meshes through the
lockstep simulator (forward and gradients against the single-device model).

    python bench/fuzz_equivalence.py --cases 300 --seed 0

Last line: 'fuzz: <passed>/<cases> passed'."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests import fuzz_models  # noqa: E402
from tests.test_fuzz import check_simulated  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    passed, failures = 0, []
    t0 = time.perf_counter()
    for i in range(args.cases):
        spec = fuzz_models.random_spec(rng)
        try:
            check_simulated(spec)
            passed += 1
        except Exception as e:  # noqa: BLE001 - a fuzz report lists every failure
            failures.append((spec, e))
            print(f"case {i} FAILED: {spec}\n{traceback.format_exc(limit=3)}", flush=True)
    print(f"{args.cases} cases in {time.perf_counter() - t0:.0f} s")
    print(f"fuzz: {passed}/{args.cases} passed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
