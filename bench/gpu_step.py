"""One CUDA device: autopar's rank program against the plain model, and an 8-way sharded
program's ranks run on the same GPU against the unsharded step.

    python bench/gpu_step.py [--layers 4] [--hidden 1024] [--seq 512] [--batch 8] [--steps 10]

A Llama-shaped model (random weights), AdamW, fp32 with TF32 matmuls unless said:

1. NCCL with one rank, mesh (1,): the plain eager step; autopar eager; autopar with
   Options(compile=True) (Inductor) against torch.compile of the plain model; autopar
   with Options(cuda_graphs=True) against torch.compile(mode="reduce-overhead") of the
   plain model (CUDA graphs; CUDA only); autopar with param_dtype=bf16 against the plain
   model under torch.autocast(bf16). Each line prints the median step and the ratio
   autopar/plain (<= 1.00 is the goal); the two sides of a line take turns step by step.
2. The plan for mesh (2, 4) on the h200 preset (training), every rank's program run in
   lockstep on this one GPU (passes/lower/simulate_mesh.py: collectives become local copies):
   eight ranks' forward and backward against one unsharded forward and backward. The
   ratio (8 ranks' time / unsharded) is the cost of smaller kernels and of the moves
   themselves (1.00 would be perfect splitting); the predicted per-rank compute of the
   plan is printed beside the measured time / 8. On CUDA a second line has both steps
   captured whole as CUDA graphs and replayed: the kernels without Python and dispatch
   (target: within 1.5x of the unsharded step).

Needs CUDA; prints one line per figure and a summary. NCCL refuses several ranks on one
GPU, so the multi-rank runtime is measured on gloo (bench/peer_speed.py)."""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autopar  # noqa: E402
from autopar import _compat  # noqa: E402
from autopar.core.mesh import Mesh  # noqa: E402
from autopar.core.options import Options  # noqa: E402
from autopar.passes.lower.emit import emit, local_inputs  # noqa: E402
from autopar.passes.plan.planning import plan_traced  # noqa: E402
from autopar.passes.lower.simulate_mesh import run_lockstep  # noqa: E402
from autopar.passes.trace.trace import flatten_inputs, trace  # noqa: E402
from autopar.tools.simulated import loss_of  # noqa: E402

CUDA = torch.device("cuda", 0)  # --device cpu checks the script itself on a machine without one


def llama(layers: int, hidden: int, vocab: int = 32000):
    from transformers import LlamaConfig, LlamaForCausalLM
    heads = max(1, hidden // 128)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=4096, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(CUDA).train()


def median_s(sides: dict[str, Callable[[], object]], steps: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per step of each side; the sides take turns step by step, so a slow
    spell of the machine falls on every side alike."""
    for _ in range(warmup):
        for step in sides.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(steps):
        for name, step in sides.items():
            _sync()
            t0 = time.perf_counter()
            step()
            _sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _sync() -> None:
    if CUDA.type == "cuda":
        torch.cuda.synchronize()


def train_step(module, kwargs: dict, autocast: bool = False) -> Callable[[], None]:
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        with torch.autocast(CUDA.type, dtype=torch.bfloat16, enabled=autocast):
            loss = module(**kwargs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def one_rank(model, kwargs: dict, steps: int) -> list[tuple[str, float, float]]:
    """(side, autopar s, plain s) per line of section 1, the two sides of a line in turns."""
    rows = []

    def row(name: str, pm, plain, autocast: bool = False) -> None:
        t = median_s({"autopar": train_step(pm, kwargs), "plain": train_step(plain, kwargs, autocast)}, steps)
        rows.append((name, t["autopar"], t["plain"]))
    row("eager fp32", autopar.compile(copy.deepcopy(model), (), kwargs, mesh=(1,), device="h200"), copy.deepcopy(model))
    row("compiled fp32", autopar.compile(copy.deepcopy(model), (), kwargs, mesh=(1,), device="h200", compile=True),
        torch.compile(copy.deepcopy(model)))
    if CUDA.type == "cuda":  # CUDA graphs are refused on a CPU rank
        row("cuda graphs fp32", autopar.compile(copy.deepcopy(model), (), kwargs, mesh=(1,), device="h200",
                                                cuda_graphs=True),
            torch.compile(copy.deepcopy(model), mode="reduce-overhead"))
    row("eager bf16 (autocast baseline)", autopar.compile(copy.deepcopy(model), (), kwargs, mesh=(1,), device="h200",
                                                          param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        copy.deepcopy(model), autocast=True)
    return rows


Row = tuple[str, float, float]


def eight_way(model, kwargs: dict, steps: int, mesh: tuple[int, ...]) -> tuple[list[Row], float, str]:
    """([(how, 8 ranks' fwd+bwd s in lockstep, unsharded fwd+bwd s)], predicted per-rank
    compute s, plan summary): eager, and on CUDA each side captured as one CUDA graph."""
    traced = trace(model, (), kwargs)
    plan = plan_traced(traced, Mesh(mesh), Options(device="h200", training=True))[1]
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    detached = {k: v.detach() for k, v in state.items()}
    user = flatten_inputs((), kwargs)[0]
    programs, inputs = [], []
    for r in range(plan.mesh.size):
        prog = emit(traced, plan, plan.mesh.coords(r), CUDA)
        local = local_inputs(prog, detached, traced.constants, user, plan.mesh.shape, state_is_local=False)
        for gi, t in zip(prog.inputs, local):
            if gi.kind.is_state and t.is_floating_point():
                t.requires_grad_(True)
        programs.append(prog.gm)
        inputs.append(local)

    def sharded() -> None:
        outs = run_lockstep(programs, plan.mesh, inputs)
        torch.autograd.backward([loss_of(_compat.tree_unflatten(_compat.tree_flatten(o)[0], traced.out_spec))
                                 for o in outs])

    ref = copy.deepcopy(model)

    def unsharded() -> None:
        loss_of(ref(**kwargs)).backward()
    split = sum(1 for n in plan.nodes if n.kind == "parameter" and n.outputs and not n.outputs[0].is_replicated())
    t = median_s({"sharded": sharded, "unsharded": unsharded}, steps)
    rows = [("eager", t["sharded"], t["unsharded"])]
    if CUDA.type == "cuda":  # the same two steps each captured whole as one CUDA graph and replayed
        try:
            g = median_s({"sharded": cuda_graphed(sharded), "unsharded": cuda_graphed(unsharded)}, steps)
            rows.append(("cuda graphs", g["sharded"], g["unsharded"]))
        except Exception as e:  # noqa: BLE001 - reported in the row, the eager figures stand
            print(f"cuda graphs of the lockstep step could not be captured: {type(e).__name__}: {e}", flush=True)
    return rows, plan.compute_s, f"{split} parameters split"


def cuda_graphed(step: Callable[[], None]) -> Callable[[], None]:
    """`step` (forward and backward, gradients accumulating in place) warmed up on a side
    stream, captured once as a CUDA graph, and replayed on each call: what the step costs
    without Python and dispatch, the kernels alone."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--mesh", default="2,4")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: one-rank,eight-way")
    ap.add_argument("--device", default="cuda", help="cpu: check the script itself (gloo, tiny sizes)")
    args = ap.parse_args()
    global CUDA
    CUDA = torch.device(args.device) if args.device != "cuda" else torch.device("cuda", 0)
    if CUDA.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu_step.py needs a CUDA device")
    warnings.simplefilter("ignore")
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"device {_compat.device_name(CUDA)}, torch {torch.__version__}, llama {args.layers} layers x "
          f"{args.hidden}, batch {args.batch} x seq {args.seq}, median of {args.steps} steps", flush=True)
    model = llama(args.layers, args.hidden)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=CUDA)
    kwargs = {"input_ids": ids, "labels": ids}
    ratios = []
    if "one-rank" not in args.skip:
        with tempfile.TemporaryDirectory() as tmp:
            backend = "nccl" if CUDA.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                    device_id=CUDA if CUDA.type == "cuda" else None)
            try:
                for side, mine, plain in one_rank(model, kwargs, args.steps):
                    ratios.append(mine / plain)
                    print(f"one rank, {backend.upper()}, {side:<32} autopar {mine * 1e3:8.2f} ms  plain {plain * 1e3:8.2f} ms  "
                          f"ratio {mine / plain:.2f}", flush=True)
            finally:
                dist.destroy_process_group()
    if "eight-way" not in args.skip:
        mesh = tuple(int(x) for x in args.mesh.split(","))
        n = 1
        for s in mesh:
            n *= s
        rows, predicted, what = eight_way(model, kwargs, max(3, args.steps // 2), mesh)
        for how, lock, whole in rows:
            print(f"{n}-way plan {mesh} ({what}) on one GPU, {how}: {n} ranks' fwd+bwd {lock * 1e3:.2f} ms, "
                  f"unsharded {whole * 1e3:.2f} ms, ratio {lock / whole:.2f}; per rank measured "
                  f"{lock / n * 1e3:.3f} ms, predicted compute {predicted * 1e3:.3f} ms", flush=True)
    if ratios:
        print(f"worst one-rank autopar/plain ratio: {max(ratios):.2f}")


if __name__ == "__main__":
    main()
