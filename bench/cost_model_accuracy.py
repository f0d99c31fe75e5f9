"""Predicted vs measured step time on 8 gloo ranks, mesh (2, 4), for tiny-to-small GPT-2s.

    python bench/cost_model_accuracy.py [--cost-model profile|analytic] [--steps 10]

Each config is compiled with the chosen cost model (default: profile, i.e. op timings
measured on this machine and links calibrated on this process group, cached in a temp
file), run for warm-up + --steps steps, and the median per-step time (slowest rank) is
compared with the plan's prediction, for forward (inference plan) and forward+backward
(training plan). The prediction is the overlapped step (cost_models/overlap.py):
compute + comm - hidden, hidden being what gradient buckets hide under backward.
The compute is the ops' timings, scaled by two measured factors the bench prints: how
much slower ranks sharing cores run (contention), and how much slower ops run inside
this config's rank program than timed alone (the first plan's program, run whole on
rank 0 with stand-in collectives: runtime/measure.py calibrate_program).
Last line: 'predicted/measured: <median ratio>'.

The configs: GPT-2 blocks from 64 to 512 wide (the sizes a 2-core host runs in
seconds), each as inference and as training, so the median covers forward-only steps
(Megatron-style all-reduces on the critical path), training steps whose parameters fit
one 25 MiB gradient bucket (launched after the last gradient: nothing hidden), and one
whose 67 MB of parameters fill three buckets (the first two hide under backward)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import warnings
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _timing import median_step_s  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

CONFIGS = [  # (layers, hidden, heads, vocab, batch, seq)
    (2, 64, 4, 512, 8, 64),
    (4, 128, 4, 2048, 8, 64),
    (4, 256, 8, 4096, 8, 128),
    (4, 512, 8, 8192, 8, 64),  # 67 MB of fp32 parameters: three gradient buckets
]


def run(rank: int, world: int, args, profile_path: str) -> None:
    import transformers
    import autopar
    torch.set_num_threads(1)
    rows = []
    for layers, hidden, heads, vocab, batch, seq in CONFIGS:
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                      n_positions=seq, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      use_cache=False, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
        for mode in ("forward", "forward+backward"):
            model = transformers.GPT2LMHeadModel(cfg).train(mode != "forward")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pm = autopar.compile(model, (), {"input_ids": ids, "labels": ids}, mesh=(2, 4),
                                     cost_model=args.cost_model, profile_path=profile_path)

            def step():
                if mode == "forward":
                    with torch.no_grad():
                        pm(input_ids=ids, labels=ids)
                else:
                    pm(input_ids=ids, labels=ids).loss.backward()

            measured = median_step_s(step, args.steps)
            plan = pm.plan
            note = plan.cost_note
            rows.append((f"{layers}L/{hidden}h b{batch}x{seq}", mode, _in_program(pm, profile_path, mode != "forward"),
                         plan.compute_s, plan.comm_s, plan.hidden_s, plan.total_s, measured))
    if rank == 0:
        print(f"{'model':<18} {'step':<17} {'in-program':>10} {'pred compute':>12} {'pred comm':>10} {'hidden':>9} "
              f"{'predicted':>10} {'measured':>10} {'pred/meas':>9}")
        for name, mode, f, c, m, h, p, meas in rows:
            print(f"{name:<18} {mode:<17} {f:>9.2f}x {c * 1e3:>10.2f}ms {m * 1e3:>8.2f}ms {h * 1e3:>7.2f}ms "
                  f"{p * 1e3:>8.2f}ms {meas * 1e3:>8.2f}ms {p / meas:>9.2f}")
        ratios = [p / meas for *_, p, meas in rows]
        print(f"cost model: {args.cost_model}; {world} gloo ranks on {os.cpu_count()} cores; {note}")
        print(f"predicted/measured: {statistics.median(ratios):.2f}")


def _in_program(pm, profile_path: str, training: bool) -> float:
    """The program factor the plan was priced with (rank 0 wrote it to the profile)."""
    from autopar.cost_models.profile import program_key
    from autopar.passes.plan.planning import load_profile
    if dist.get_rank() != 0:
        return float("nan")
    key = program_key(pm.current.traced.fingerprint, pm.mesh.shape, training)
    return load_profile(profile_path).program_factor.get(key, 1.0)


def _spawned(rank, world, store, args, profile_path):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    try:
        run(rank, world, args, profile_path)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", default="profile", help="profile, analytic, or a saved profile's path")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned, args=(8, os.path.join(tmp, "store"), args, os.path.join(tmp, "profile.json")),
                           nprocs=8, start_method="spawn")


if __name__ == "__main__":
    main()
