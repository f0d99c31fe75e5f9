"""Decode speed of autopar's generation against torch's tensor parallelism, 8 gloo ranks,
one torch thread per rank, the same model (a Llama, random weights from one seed), the
same static KV cache (autopar/runtime/kv_cache.CachedLM: max_batch x kv_heads x
max_cache_len x head_dim per layer) and the same prompt on both sides:

  - autopar: compile_for_generation(model, mesh=(1, 8)), the solver choosing every layout
    (the cache's too); its decode plan is timed;
  - torch TP: parallelize_module with the Megatron plan (column-parallel q/k/v/gate/up,
    row-parallel o/down, lm_head column-parallel with its logits gathered) on 8 ranks,
    each rank holding its KV heads' block of the cache.

    python bench/generate_speed.py [--steps 20] [--hidden 512] [--layers 2]

Both first generate the same greedy tokens (checked equal: the same model and cache),
then one decode step (the model on one new token per row, and its argmax) is timed:
median over steps, slowest rank. Prints decode tokens/s (batch rows per step / step
time) for both, the cache layout autopar chose, and last
'decode tokens/s, autopar over torch TP: <x>' (>= 1: autopar is the faster)."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _launch import launch  # noqa: E402
from _timing import median_step_s  # noqa: E402


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8)
    return LlamaForCausalLM(config).eval()


def torch_tp(model, world: int, args):
    """The Megatron plan on a 1-d mesh, and a CachedLM whose cache holds this rank's KV heads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from autopar.runtime.kv_cache import CachedLM

    mesh = init_device_mesh("cpu", (world,))
    col, row = ColwiseParallel(), RowwiseParallel()
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col,
                                         "self_attn.o_proj": row, "mlp.gate_proj": col, "mlp.up_proj": col,
                                         "mlp.down_proj": row})
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    cached = CachedLM(model, args.batch, args.cache)
    for name in cached.cache_names():  # this rank's heads only
        full = getattr(cached, name)
        setattr(cached, name, torch.zeros(full.shape[0], full.shape[1] // world, *full.shape[2:], dtype=full.dtype))
    return cached


def decode_timer(step, batch: int, start: int, limit: int):
    """One decode step per call, at the next position (wrapping before the cache's end)."""
    state = {"pos": start, "tok": torch.zeros(batch, 1, dtype=torch.long)}

    def one() -> None:
        logits = step(state["tok"], torch.tensor([state["pos"]]))
        state["tok"] = logits[:, -1].argmax(-1, keepdim=True)
        state["pos"] = start if state["pos"] + 1 >= limit else state["pos"] + 1
    return one


def run(rank: int, world: int, args) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import autopar
    from autopar.runtime.generation import Generator

    model = build(args)
    prompt = torch.randint(0, 1024, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    gen = autopar.compile_for_generation(copy.deepcopy(model), mesh=(1, world), max_batch=args.batch,
                                         max_cache_len=args.cache, prefill_len=args.prompt)
    peer = Generator(torch_tp(copy.deepcopy(model), world, args), gen.shape, args.prompt)
    ours, theirs = gen.generate(prompt, args.new), peer.generate(prompt, args.new)
    if not torch.equal(ours, theirs):
        raise SystemExit(f"rank {rank}: autopar and torch TP generate different tokens:\n{ours}\n{theirs}")
    start = args.prompt + args.new
    ap_s = median_step_s(decode_timer(gen.step, args.batch, start, args.cache), args.steps)
    tp_s = median_step_s(decode_timer(peer.step, args.batch, start, args.cache), args.steps)
    if rank == 0:
        pm = gen.step
        print(f"model: llama hidden {args.hidden}, {args.layers} layers, 8 heads; batch {args.batch}, cache "
              f"{args.cache}, {world} gloo ranks, 1 thread each; tokens equal: True")
        print(f"autopar cache layout: {pm.state_specs['key_cache_0']} (local block "
              f"{tuple(pm.state_tensors['key_cache_0'].shape)}), plans: {len(pm.programs)}")
        print(f"autopar  decode: {ap_s * 1e3:8.2f} ms/step  {args.batch / ap_s:9.1f} tokens/s")
        print(f"torch TP decode: {tp_s * 1e3:8.2f} ms/step  {args.batch / tp_s:9.1f} tokens/s")
        print(f"decode tokens/s, autopar over torch TP: {tp_s / ap_s:.3f} (>= 1: autopar is the faster)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=4)
    p.add_argument("--cache", type=int, default=128)
    launch(run, p.parse_args(), 8, timeout_s=1800)


if __name__ == "__main__":
    main()
