"""Expert parallelism timed (issue #26): one training step (forward, backward, SGD) of a
stack of MoE MLP blocks on 4 gloo ranks, three ways side by side in one run:

  (a) autopar's hand plan style "ep" on mesh (4,): experts split by expert, each rank's
      routed rows sent to their expert's rank by all_to_all_single (autopar/runtime/experts.py),
      the other parameters fsdp;
  (b) hand plan style "data_parallel" on mesh (4,), each routed_experts node also pinned
      to read its experts whole (the style alone leaves that to the solver, which here
      splits some layers' replicated experts and sends rows by all-to-all): every expert
      on every rank, tokens split by batch, gradients all-reduced;
  (c) expert parallelism written by hand in torch (torchtitan's form): the same weights,
      each rank's experts [r * E/4, (r + 1) * E/4), per-expert counts exchanged, rows sent
      and returned by torch.distributed.all_to_all_single in an autograd function, the
      routing weights applied after the rows come back, the replicated router and norm
      gradients all-reduced in one flat buffer.

    python bench/moe_speed.py [--steps 6] [--layers 2] [--hidden 512] [--experts 8] [--top-k 2]
                              [--width 1024] [--batch 8] [--seq 256] [--save bench/results/moe_speed.txt]

The model is written here, not taken from transformers: each block is x + experts(rmsnorm(x))
with a softmax top-k router and experts as 3-D parameters [E, in, out] run through
transformers' grouped_mm pattern (sort by expert, gather, histc + cumsum offsets,
grouped matmuls, unsort), which autopar's trace pass (passes/trace/experts.py) makes one
routed_experts node per block; the run checks that it did. Loss: mean of the output squared.
The sides take turns step by step (bench/_timing.py), one torch thread per rank; rank 0
prints each side's median step (slowest rank), the ratios a/b and a/c, the cost model's
predicted step of plans (a) and (b), and checks that (a), (b) and (c) give the same loss
at step 0 (the same work is timed) and at step 1 (the same gradients were applied). What
the figures can mean here is printed last.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import subprocess
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _launch import launch  # noqa: E402
from _timing import median_steps_s  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
# transformers' dispatcher: torch's grouped_mm where it takes these dtypes, else its own op (fp32 on CPU)
from transformers.integrations.moe import _grouped_mm as grouped_mm  # noqa: E402

WORLD = 4
ROUTED = "autopar.routed_experts.default"
LOSS_RTOL = 1e-5  # fp32: the sides sum the same products in different orders

LIMITS = """\
What this can and cannot mean: the 4 ranks share 2 CPU cores with other jobs and gloo
sends over loopback TCP, so a collective's time here is per-call overhead, copies and
ranks waiting for a core, not link bandwidth. It says nothing about all-to-all over
NVLink or InfiniBand, nor whether expert parallelism pays on GPUs: a/b mostly weighs
(b)'s all-reduce of every expert's gradient (all experts' fp32 weights, every step)
against (a)'s all-to-alls of routed rows on this loopback, which a real fabric prices
very differently. The work is equal (the step-0 and step-1 losses agree), so a/c does
show what autopar's exchange and rank program cost over hand-written expert
parallelism at this size: per MoE layer autopar also sends every row's routing weight by
all-to-all (the hand version weights rows after they return; both exchange
per-expert counts once), sorts again, and gathers the fsdp router and norms.
Medians of a few steps on a loaded machine move by some 10% between runs. The cost
model's predictions use the cpu preset's links and cores, not this contention: read
them as the plans' ranking, not a forecast of these milliseconds."""


def expert_mlp(rows: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each row by its expert: rows sorted by expert, offsets cumulative counts
    (transformers' grouped matmul, as its MoE layers call it)."""
    gate, up = grouped_mm(rows, gate_up, offsets).chunk(2, dim=-1)
    return grouped_mm(F.silu(gate) * up, down, offsets)


class Experts(nn.Module):
    """E experts as 3-D parameters ([E, in, out], transformers' is_transposed layout)."""

    def __init__(self, num_experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, hidden, 2 * width) * hidden ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, width, hidden) * width ** -0.5)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """transformers' grouped_mm_experts_forward: h [T, H], ids and weights [T, k]."""
        tokens, k = ids.shape
        sorted_ids, perm = torch.sort(ids.reshape(-1))
        rows = h[perm // k]
        row_weights = weights.reshape(-1)[perm]
        counts = torch.histc(sorted_ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        y = expert_mlp(rows, offsets, self.gate_up_proj, self.down_proj) * row_weights.unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return y[inv].view(tokens, k, -1).sum(dim=1)


def route(h: torch.Tensor, router: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router: softmax over experts, top-k, weights renormalised."""
    probs = F.softmax(F.linear(h, router), dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, width: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm = nn.RMSNorm(hidden)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm(x).view(-1, d)
        weights, ids = route(h, self.router.weight, self.top_k)
        return x + self.experts(h, ids, weights).view(b, s, d)


class MoEStack(nn.Module):
    def __init__(self, layers: int, hidden: int, num_experts: int, top_k: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock(hidden, num_experts, top_k, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return (x.float() ** 2).mean()


class _AllToAll(torch.autograd.Function):
    """Rows in_splits[i] of x go to rank i; out_splits[i] rows come from it. Backward: the
    same exchange the other way round."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        dist.all_to_all_single(back, g.contiguous(), in_splits, out_splits)
        return back, None, None


class HandExpertParallel(nn.Module):
    """Side (c): `base`'s weights, this rank's block of experts, its batch rows in."""

    def __init__(self, base: MoEStack, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        self.num_experts = base.blocks[0].experts.num_experts
        self.local = self.num_experts // world
        self.top_k = base.blocks[0].top_k
        self.eps = base.blocks[0].norm.eps
        mine = slice(rank * self.local, (rank + 1) * self.local)

        def own(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().clone().contiguous())
        self.norms = nn.ParameterList(own(b.norm.weight) for b in base.blocks)
        self.routers = nn.ParameterList(own(b.router.weight) for b in base.blocks)
        self.gate_up = nn.ParameterList(own(b.experts.gate_up_proj[mine]) for b in base.blocks)
        self.down = nn.ParameterList(own(b.experts.down_proj[mine]) for b in base.blocks)

    def replicated(self) -> list[nn.Parameter]:
        return [*self.norms, *self.routers]

    def moe(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        n, local, k = self.world, self.local, self.top_k
        weights, ids = route(h, self.routers[layer], k)
        sorted_ids, perm = torch.sort(ids.reshape(-1))
        # counts per expert: this rank's rows for every expert; received, per (source, local expert)
        send_counts = torch.bincount(sorted_ids, minlength=self.num_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_splits = send_counts.view(n, local).sum(1).tolist()
        recv_by_source = recv_counts.view(n, local)
        recv_splits = recv_by_source.sum(1).tolist()
        # dispatch; the rows arrive grouped by source, then local expert: regroup by expert
        got = _AllToAll.apply(h[perm // k], recv_splits, send_splits)
        local_ids = torch.repeat_interleave(torch.arange(local).repeat(n), recv_counts)
        by_expert = torch.argsort(local_ids, stable=True)
        offsets = torch.cumsum(recv_by_source.sum(0), dim=0, dtype=torch.int32)
        y = expert_mlp(got[by_expert], offsets, self.gate_up[layer], self.down[layer])
        y = y[torch.argsort(by_expert)]
        # combine, weight, unsort
        back = _AllToAll.apply(y, send_splits, recv_splits) * weights.reshape(-1)[perm].unsqueeze(-1)
        return back[torch.argsort(perm)].view(-1, k, back.shape[-1]).sum(dim=1)

    def forward(self, x: torch.Tensor, global_numel: int) -> torch.Tensor:
        """This rank's share of the global loss (the ranks' shares sum to it)."""
        for layer in range(len(self.norms)):
            b, s, d = x.shape
            h = F.rms_norm(x, (d,), self.norms[layer], self.eps).view(-1, d)
            x = x + self.moe(h, layer).view(b, s, d)
        return (x.float() ** 2).sum() / global_numel


def _sync_replicated(params: list[nn.Parameter]) -> None:
    """Sum the replicated parameters' gradients over the ranks, in one flat all-reduce."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


def _planned_on_rank0(make):
    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def replicated_experts_plan(model: MoEStack, x: torch.Tensor):
    """Hand style data_parallel with every routed_experts node also pinned to read its
    experts whole. The style alone pins the parameters replicated but leaves the op's
    expert inputs to the solver, which may slice the replicated experts locally and send
    rows by all-to-all (expert parallelism again, not what (b) is for)."""
    from autopar.core.mesh import Mesh
    from autopar.core.placement import R
    from autopar.core.routed import ROUTED_EXPERTS
    from autopar.passes.plan.hand_plans import hand_pins
    from autopar.passes.plan.planning import options_with, plan_traced, trace_for_planning
    from autopar.passes.strategies.strategies import OpInput
    traced = trace_for_planning(model, (x,), None)
    pins = hand_pins(model, traced, (WORLD,), "data_parallel")
    for node in traced.gm.graph.nodes:
        if node.target is ROUTED_EXPERTS:
            first = 1 + len(node.args[1])  # tensor inputs: ids, row sources, experts
            pins.update({OpInput(node.name, first + k): (R,) for k in range(len(node.args[2]))})
    return plan_traced(traced, Mesh.of((WORLD,)), options_with(None, {"device": "cpu"}), pins)[1]


def _autopar_side(base: MoEStack, x: torch.Tensor, style: str, lr: float):
    import autopar
    model = copy.deepcopy(base).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make = (lambda: replicated_experts_plan(model, x)) if style == "replicated" else \
            (lambda: autopar.hand_plan(model, (x,), mesh=(WORLD,), style=style, device="cpu"))
        plan = _planned_on_rank0(make)
        pm = autopar.compile(model, (x,), mesh=(WORLD,), plan=plan, device="cpu")
    opt = torch.optim.SGD(pm.parameters(), lr=lr)

    def step() -> torch.Tensor:
        loss = pm(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, pm.plan


def _hand_side(base: MoEStack, x: torch.Tensor, rank: int, lr: float):
    model = HandExpertParallel(base, rank, WORLD)
    x_local = x.chunk(WORLD)[rank]
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step() -> torch.Tensor:
        loss = model(x_local, x.numel())
        loss.backward()
        _sync_replicated(model.replicated())
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def _plan_line(name: str, plan) -> str:
    routed = [n for n in plan.nodes if n.op == ROUTED]
    layouts = sorted({f"{n.inputs[-1]}/{n.inputs[0]}" for n in routed})
    return (f"  plan {name}: predicted {plan.total_s * 1e3:.1f} ms/step (compute {plan.compute_s * 1e3:.1f}, "
            f"communication {plan.comm_s * 1e3:.1f}); {len(routed)} routed_experts nodes, experts/ids "
            f"{', '.join(layouts) or '-'}")


def run(rank: int, world: int, args) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = MoEStack(args.layers, args.hidden, args.experts, args.top_k, args.width).train()
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    step_a, plan_a = _autopar_side(base, x, "ep", args.lr)
    step_b, plan_b = _autopar_side(base, x, "replicated", args.lr)
    step_c = _hand_side(base, x, rank, args.lr)
    for name, plan in (("ep", plan_a), ("replicated experts", plan_b)):
        if not any(n.op == ROUTED for n in plan.nodes):
            raise RuntimeError(f"plan {name} has no {ROUTED} node: the trace pass did not recognise this model's "
                               f"routing ({'; '.join(plan.routing_notes) or 'no note'})")
    sides = {"a": step_a, "b": step_b, "c": step_c}
    # steps 0 and 1 on every side in turn: the same weights and data give the same loss at
    # step 0, and the same gradients the same loss at step 1
    losses: dict[str, list[torch.Tensor]] = {s: [] for s in sides}
    for _ in range(2):
        for s, step in sides.items():
            losses[s].append(step())
    for loss in losses["c"]:
        dist.all_reduce(loss)  # the ranks' shares of the global loss
    timed = median_steps_s(sides, args.steps, args.warmup)
    if rank != 0:
        return
    with warnings.catch_warnings():  # predicted only: what the unpinned styles would run
        warnings.simplefilter("ignore")
        import autopar
        plan_dp = autopar.hand_plan(base, (x,), mesh=(WORLD,), style="data_parallel", device="cpu")
        plan_auto = autopar.plan(base, (x,), mesh=(WORLD,), device="cpu")
    a, b, c = (timed[s] for s in "abc")
    agree = [all(torch.allclose(losses[s][i], losses["c"][i], rtol=LOSS_RTOL, atol=0) for s in "ab") for i in (0, 1)]
    lines = [
        f"MoE stack: {args.layers} blocks x (rmsnorm, softmax top-{args.top_k} router, {args.experts} SwiGLU experts "
        f"{args.hidden}->{args.width}->{args.hidden} as 3-D parameters, grouped_mm); batch {args.batch} x "
        f"{args.seq}, fp32, SGD, {WORLD} gloo ranks on mesh ({WORLD},), one torch thread each",
        *(f"step-{i} loss: (a) {losses['a'][i].item():.8f}, (b) {losses['b'][i].item():.8f}, "
          f"(c) {losses['c'][i].item():.8f}: "
          + (f"equal within rtol {LOSS_RTOL:g}" if agree[i] else f"DIFFER beyond rtol {LOSS_RTOL:g}") for i in (0, 1)),
        f"median step, slowest rank, {args.steps} turns after {args.warmup + 2} untimed:",
        f"  (a) autopar ep plan (experts split, rows by all-to-all):  {a * 1e3:8.1f} ms",
        f"  (b) autopar data parallel plan (experts replicated):      {b * 1e3:8.1f} ms",
        f"  (c) hand-written torch expert parallelism (all_to_all):   {c * 1e3:8.1f} ms",
        f"ratio a/b {a / b:.2f}  (autopar ep / data parallel)",
        f"ratio a/c {a / c:.2f}  (autopar ep / hand-written ep)",
        "cost model (cpu preset):",
        _plan_line("(a) ep", plan_a),
        _plan_line("(b) data_parallel, experts pinned whole", plan_b),
        f"  predicted a/b {plan_a.total_s / plan_b.total_s:.2f}",
        "  not timed:",
        _plan_line("data_parallel style as is", plan_dp),
        _plan_line("autopar's own", plan_auto),
    ]
    text = "\n".join(lines + ["", LIMITS])
    print(text, flush=True)
    if args.save:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        header = (f"# python bench/moe_speed.py {' '.join(sys.argv[1:])}".rstrip()
                  + f"  ({WORLD} gloo ranks, 2 shared cores, {datetime.date.today()}, commit {commit or '?'}, "
                  f"torch {torch.__version__})")
        with open(args.save, "w") as f:
            f.write(header + "\n" + text + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="timed turns per side")
    p.add_argument("--warmup", type=int, default=1, help="untimed turns per side after steps 0 and 1")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--width", type=int, default=1024, help="expert width (moe_intermediate_size)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                    "moe_speed.txt"), help="result file ('' to not save)")
    args = p.parse_args()
    if args.experts % WORLD or args.batch % WORLD:
        p.error(f"--experts and --batch must divide over {WORLD} ranks")
    launch(run, args, WORLD, timeout_s=900)


if __name__ == "__main__":
    main()
