"""Count how often gloo ranks abort with several collectives in flight per group, on
torch's gloo groups (two worker threads each) and on autopar's (one: serial_gloo.py).

    python bench/gloo_stress.py --runs 12 --rounds 3000

Each run is a fresh job of four ranks on a (2, 2) mesh: a group per row, per column
and one over all four, as autopar makes them. A round launches one to eight functional
collectives (all-reduce, in-place all-reduce, all-gather, reduce-scatter, all-to-all,
float32 or bfloat16, random sizes, on a random group), makes and frees scratch
tensors between launches, then waits for them in a shuffled order and checks each
result. Every rank draws from one seed, so all ranks issue the same collectives in the
same order per group, as a rank program does. The sides take turns run by run; a run
is counted as aborted when its job dies of a signal or times out, as wrong when a
result differs from what the collective must give.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SIDES = ("gloo", "serial")  # torch's groups, autopar's groups
WORLD = 4
KINDS = ("all_reduce", "all_reduce_", "all_gather", "reduce_scatter", "all_to_all")


def _rank(rank: int, side: str, rounds: int, store: str, seed: int) -> None:
    import torch
    import torch.distributed as dist

    from autopar._compat import report_fatal_signals
    from autopar.runtime.serial_gloo import serial_gloo

    torch.set_num_threads(1)
    report_fatal_signals()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    backend = serial_gloo() if side == "serial" else "gloo"
    rows = [dist.new_group([0, 1], backend=backend), dist.new_group([2, 3], backend=backend)]
    cols = [dist.new_group([0, 2], backend=backend), dist.new_group([1, 3], backend=backend)]
    every = dist.new_group(list(range(WORLD)), backend=backend)
    groups = [(every, list(range(WORLD))), (rows[rank // 2], [rank // 2 * 2, rank // 2 * 2 + 1]),
              (cols[rank % 2], [rank % 2, rank % 2 + 2])]
    c10d = torch.ops._c10d_functional
    rng = random.Random(seed)
    for _ in range(rounds):
        pending = []
        for _ in range(rng.randint(1, 8)):
            group, members = rng.choice(groups)
            n, name, kind = len(members), group.group_name, rng.choice(KINDS)
            dtype = rng.choice((torch.float32, torch.bfloat16))
            shape = (n * rng.randint(1, 64), rng.randint(1, 300))
            # rank r's tensor holds r + 1 everywhere: every result is known without a reference
            x = torch.full(shape, float(rank + 1), dtype=dtype)
            total = float(sum(m + 1 for m in members))
            if kind == "all_reduce":
                pending.append((c10d.all_reduce(x, "sum", name), total))
            elif kind == "all_reduce_":
                pending.append((c10d.all_reduce_(x, "sum", name), total))
            elif kind == "all_gather":
                gathered = torch.tensor([float(m + 1) for m in members]).repeat_interleave(shape[1] * shape[0])
                pending.append((c10d.all_gather_into_tensor(x.t().contiguous(), n, name), gathered))
            elif kind == "reduce_scatter":
                pending.append((c10d.reduce_scatter_tensor(x, "sum", n, name), total))
            else:
                split = [shape[0] // n] * n
                came = torch.tensor([float(m + 1) for m in members]).repeat_interleave(split[0] * shape[1])
                pending.append((c10d.all_to_all_single(x, split, split, name), came))
            del x
            scratch = [torch.empty(rng.randint(1, 5000)) for _ in range(rng.randint(0, 20))]
            del scratch
        rng.shuffle(pending)
        for out, want in pending:
            got = c10d.wait_tensor(out).float().flatten()
            expected = want.float() if isinstance(want, torch.Tensor) else torch.full_like(got, want)
            if not torch.equal(got, expected):
                print(f"WRONG rank {rank}: {got[:4].tolist()} != {expected[:4].tolist()}", flush=True)
                sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()


def _job(side: str, rounds: int, seed: int, timeout_s: float) -> str:
    """One job of WORLD ranks: 'ok', 'aborted' (a signal, or a rank's exit code says so),
    'wrong' or 'timeout'."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        code = f"import sys; sys.path.insert(0, {ROOT!r}); from bench.gloo_stress import _rank; " \
               f"_rank(int(sys.argv[1]), {side!r}, {rounds}, {store!r}, {seed})"
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
        deadline = time.monotonic() + timeout_s
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for p in procs:
            p.kill()
            p.wait()
        logs = [p.stdout.read() for p in procs]
    if any(c is not None and c < 0 for c in codes):
        return "aborted"
    if any("WRONG" in log for log in logs):
        return "wrong"
    if any(c is None for c in codes):
        return "timeout"
    return "ok" if all(c == 0 for c in codes) else "aborted"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=12, help="jobs per side")
    ap.add_argument("--rounds", type=int, default=3000, help="rounds of collectives per job")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before a job counts as hung")
    args = ap.parse_args()
    counts = {side: {} for side in SIDES}
    seconds = {side: [] for side in SIDES}
    for run in range(args.runs):
        for side in SIDES:  # the sides take turns
            start = time.monotonic()
            verdict = _job(side, args.rounds, seed=run, timeout_s=args.timeout)
            seconds[side].append(time.monotonic() - start)
            counts[side][verdict] = counts[side].get(verdict, 0) + 1
            print(f"run {run} {side:6s} {verdict:8s} {seconds[side][-1]:6.1f} s", flush=True)
    print(f"\n{WORLD} ranks, {args.rounds} rounds per job, {args.runs} jobs per side")
    for side in SIDES:
        median = sorted(seconds[side])[len(seconds[side]) // 2]
        tally = ", ".join(f"{k} {v}" for k, v in sorted(counts[side].items()))
        print(f"  {side:6s}: {tally}; median job {median:.1f} s")


if __name__ == "__main__":
    main()
