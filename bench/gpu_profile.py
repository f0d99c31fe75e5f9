"""A measured cost profile of this accelerator, and how well it predicts a step.

    python bench/gpu_profile.py [--out DIR] [--layers 4] [--hidden 1024] [--seq 512] [--batch 8] [--steps 10]

One rank (NCCL on CUDA; gloo with --device cpu, the script's dry run): a Llama-shaped
model is compiled with cost_model="profile", which times every op kind of its graph on
this device and writes the profile to DIR/profile-<device>.json: the file to ship for
users of this accelerator, as cost_models/profiles/<preset>.json (the preset's name, e.g.
h200), from which cost_model="saved" without a profile_path plans offline.
Then the plan's predicted step (Plan.total_s) is set beside the measured median training
step (forward and backward, no optimiser: what the cost model prices). Prints one line
per figure; last 'predicted/measured step: <x>' (target 0.8-1.25).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autopar  # noqa: E402
from autopar import _compat  # noqa: E402


def llama(layers: int, hidden: int, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM
    heads = max(1, hidden // 128)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=4096, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device).train()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder the profile file is written to")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: check the script itself (gloo, tiny sizes)")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu_profile.py needs a CUDA device (or --device cpu for a dry run)")
    warnings.simplefilter("ignore")
    name = _compat.device_name(device).replace(" ", "_")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile-{name}-torch{torch.__version__.split('+')[0]}.json")
    model = llama(args.layers, args.hidden, device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                                rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
        try:
            t0 = time.perf_counter()
            pm = autopar.compile(model, (), {"input_ids": ids, "labels": ids}, mesh=(1,), cost_model="profile",
                                 profile_path=path)
            print(f"device {_compat.device_name(device)}, torch {torch.__version__}: profiled and planned in "
                  f"{time.perf_counter() - t0:.1f} s; profile written to {path}", flush=True)
            times = []
            for i in range(args.steps + 3):
                _sync(device)
                t0 = time.perf_counter()
                pm(input_ids=ids, labels=ids).loss.backward()
                _sync(device)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            measured, predicted = statistics.median(times), pm.plan.total_s
            print(f"llama {args.layers} x {args.hidden}, batch {args.batch} x {args.seq}: measured step "
                  f"{measured * 1e3:.2f} ms, predicted {predicted * 1e3:.2f} ms", flush=True)
            print(f"predicted/measured step: {predicted / measured:.2f}", flush=True)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
