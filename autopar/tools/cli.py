"""Command line: plan, show, explain, visualize, report, diff, code, coverage, sweep, run.

    python -m autopar plan gpt2-tiny --mesh 2,4 --out plan.json
    python -m autopar show plan.json [--nodes] [--all]
    python -m autopar explain plan.json NODE
    python -m autopar visualize plan.json --out DIR
    python -m autopar report plan.json --out plan.html
    python -m autopar diff a.json b.json
    python -m autopar code gpt2-tiny --mesh 2,4 --rank 3 [--plan plan.json]
    python -m autopar coverage [models...] [--mesh 2,4] [--training]
    python -m autopar sweep [--task causal-lm] [--training] [--only llama,gpt2] [--json out.json]
    python -m autopar run [--nproc 8] [--nnodes 2 --rdzv-endpoint host:port] train.py [args...]

Models are built on the meta device to plan (no weights are made; a full-size zoo model
plans in the memory of its shapes). Exit codes: 0 done, 1 autopar refused (message on
stderr), 2 bad command line; output cut short by a closed pipe (`| head`) ends quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import autopar
from autopar import Plan
from autopar.core.errors import AutoparError
from autopar.core.files import write_json_atomic
from autopar.core.kinds import NodeKind
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.passes.lower.emit import emit
from autopar.passes.plan.planning import plan_traced, trace_for_planning
from autopar.tools import zoo
from autopar.tools.coverage import coverage, report
from autopar.tools.plan_text import collectives_by_module
from autopar.tools.report import write_html
from autopar.tools.visualize import visualize  # loads matplotlib (optional) only when it draws
from autopar.tools.simulated import CHEAP_COMM
from autopar.tools.sweep import Stage, SweepOptions, sweep
from autopar.tools.sweep_configs import Task
from autopar.tools.sweep_report import summary, to_json


def _mesh(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh must look like 2,4 (got {text!r})") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autopar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"autopar {autopar.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    models_help = f"one of {', '.join(zoo.names())}, or package.module:factory"

    def model_args(sp):
        sp.add_argument("model", help=models_help)
        sp.add_argument("--mesh", type=_mesh, required=True, help="mesh shape, e.g. 2,4")
        sp.add_argument("--device", default="cpu", help="cost-model preset: cpu, a100, h100, h200")
        sp.add_argument("--nnodes", type=int, default=1, help="machines the ranks span, as torchrun's --nnodes: "
                        "mesh axes whose groups cross them get the preset's inter-node link (default 1)")
        sp.add_argument("--batch", type=int, help="a zoo model's batch size (default 4)")
        sp.add_argument("--seq", type=int, help="a zoo model's sequence length (default 32)")
        sp.add_argument("--training", action="store_true", help="plan a training step (forward + backward)")

    sp = sub.add_parser("plan", help="plan a model offline and save the plan as JSON")
    model_args(sp)
    sp.add_argument("--out", required=True, help="where to write the plan (JSON, written atomically)")
    sp = sub.add_parser("show", help="print a saved plan")
    sp.add_argument("plan")
    sp.add_argument("--nodes", action="store_true", help="also list every node's placement")
    sp.add_argument("--all", action="store_true", help="also list every collective with its producer and consumer")
    sp = sub.add_parser("explain", help="why the plan chose what it chose for one node")
    sp.add_argument("plan")
    sp.add_argument("node", help="a node name, as show --nodes lists them")
    sp = sub.add_parser("visualize", help="draw a saved plan's pictures as PNG files (needs matplotlib)")
    sp.add_argument("plan")
    sp.add_argument("--out", required=True, help="folder for plan_tensors.png, plan_graph.png, plan_layers.png and "
                    "plan_costs.png")
    sp = sub.add_parser("report", help="write a saved plan as one self-contained HTML page")
    sp.add_argument("plan")
    sp.add_argument("--out", required=True, help="the HTML file to write (atomically)")
    sp = sub.add_parser("diff", help="compare two saved plans")
    sp.add_argument("a")
    sp.add_argument("b")
    sp = sub.add_parser("code", help="print the Python source one rank runs")
    model_args(sp)
    sp.add_argument("--rank", type=int, default=0)
    sp.add_argument("--plan", help="use this saved plan instead of solving")
    sp = sub.add_parser("coverage", help="which rules (hand, discovered, none) shard each zoo model")
    sp.add_argument("models", nargs="*", help=f"default: every tiny model ({models_help})")
    sp.add_argument("--mesh", type=_mesh, default=(2, 4), help="mesh shape (default 2,4)")
    sp.add_argument("--device", default="cpu", help="cost-model preset: cpu, a100, h100, h200")
    sp.add_argument("--training", action="store_true", help="plan training steps")
    sp.add_argument("--ops", action="store_true", help="also list the ops hand-written rules covered")
    _sweep_parser(sub)
    sp = sub.add_parser("run", help="launch a training script on this machine's ranks (a thin torchrun)")
    sp.add_argument("--nproc", default="auto", help="ranks on this node, as torchrun's --nproc-per-node: a number, "
                    "'gpu', 'cpu' or 'auto' (one per GPU, else one per CPU core; default)")
    sp.add_argument("--nnodes", type=int, default=1, help="machines (default 1: a standalone rendezvous)")
    sp.add_argument("--rdzv-endpoint", help="host:port every node meets at (needed with --nnodes > 1)")
    sp.add_argument("--rdzv-id", default="autopar", help="the job's rendezvous id (default 'autopar')")
    sp.add_argument("script", help="the Python script every rank runs (autopar.compile starts the process group)")
    sp.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def torchrun_argv(args) -> list[str]:
    """torchrun's arguments for `python -m autopar run` (one node: --standalone)."""
    if args.nnodes < 1:
        raise ValueError(f"--nnodes {args.nnodes}: the machines the job runs on, 1 or more")
    argv = [f"--nproc-per-node={args.nproc}", f"--nnodes={args.nnodes}"]
    if args.nnodes == 1 and args.rdzv_endpoint:
        raise ValueError("--rdzv-endpoint is where several nodes meet; one node (--nnodes 1) rendezvous by itself")
    if args.nnodes == 1:
        argv.append("--standalone")
    elif not args.rdzv_endpoint:
        raise ValueError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the address every node meets at "
                         "(the same on every node, e.g. the first node's host and a free port)")
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-id={args.rdzv_id}"]
    return argv + [args.script, *args.script_args]


def _launch(args) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    if not os.path.isfile(args.script):
        raise ValueError(f"no script {args.script!r} to run")
    try:
        torchrun.main(torchrun_argv(args))
    except ChildFailedError as e:  # which ranks, their exit codes or signals, where their errors went
        print(f"autopar: {len(e.failures)} rank(s) of {args.script} failed\n{e.format_msg()}", file=sys.stderr)
        return 1
    return 0


def _sweep_parser(sub) -> None:
    sp = sub.add_parser("sweep", help="every transformers architecture of a task, tiny, through every stage")
    sp.add_argument("--task", default="causal-lm", choices=[t.value for t in Task])
    sp.add_argument("--mesh", type=_mesh, default=(2, 4), help="mesh shape (default 2,4)")
    sp.add_argument("--training", action="store_true", help="plan training; compare gradients too")
    sp.add_argument("--ranks", action="store_true", help="also run each plan on real gloo ranks")
    sp.add_argument("--only", type=lambda s: s.split(","), help="comma-separated model types")
    sp.add_argument("--limit-s", type=float, default=120.0, help="seconds per architecture (default 120)")
    sp.add_argument("--until", default="ranks", help="last stage: config, single-device, export, plan, simulate")
    sp.add_argument("--device", default="cheap-comm", help="cost-model preset (default: near-free communication)")
    sp.add_argument("--jobs", type=int, default=1, help="architectures at once (default 1)")
    sp.add_argument("--json", help="write the results here (JSON, for CI trends)")


def _sweep(args) -> int:
    options = SweepOptions(Task(args.task), args.mesh, args.training, args.ranks, args.limit_s,
                           device=CHEAP_COMM if args.device == "cheap-comm" else args.device,
                           until=Stage(args.until), jobs=args.jobs)
    results = sweep(options, args.only, progress=lambda line: print(line, flush=True))
    print()
    print(summary(results, options))
    if args.json:
        write_json_atomic(args.json, to_json(results, options))
        print(f"wrote {args.json}")
    return 1 if any(r.against_autopar for r in results) else 0


def _built(args) -> tuple:
    """The model and its inputs, on meta for a zoo model; --batch/--seq size a zoo model's
    inputs only (a factory returns its own), so they are refused with a factory."""
    if ":" in args.model:
        if args.batch is not None or args.seq is not None:
            raise ValueError(f"--batch and --seq size a zoo model's inputs; the factory {args.model} returns its "
                             "own inputs: drop them, or make the factory build those sizes")
        return zoo.build(args.model)
    return zoo.build(args.model, 4 if args.batch is None else args.batch, 32 if args.seq is None else args.seq,
                     args.training, device="meta")


def _plan(args):
    model, margs, mkwargs = _built(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, margs, mkwargs, mesh=args.mesh, device=args.device, training=args.training,
                            nodes=args.nnodes), \
            (model, margs, mkwargs)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush finds no pipe
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the pipe ended


def _run(args) -> int:
    try:
        if args.command == "plan":
            plan, _ = _plan(args)
            plan.to_json(args.out)
            print(plan.summary())
            print(f"wrote {args.out}")
        elif args.command == "show":
            plan = Plan.from_json(args.plan)
            print(plan.summary())
            print("collectives by module (forward order; MiB this rank sends):")
            print("\n".join(collectives_by_module(plan)))
            if args.all:
                print("every collective (forward order):")
                for c in plan.collectives():
                    print(f"  {c}")
            if args.nodes:
                print(plan.table())
        elif args.command == "explain":
            print(_explained(Plan.from_json(args.plan), args))
        elif args.command == "visualize":
            os.makedirs(args.out, exist_ok=True)
            drawn = visualize(Plan.from_json(args.plan), os.path.join(args.out, "plan"))
            print(f"wrote {', '.join(os.path.join(args.out, f'plan_{n}.png') for n in drawn)}")
        elif args.command == "report":
            print(f"wrote {write_html(Plan.from_json(args.plan), args.out)}")
        elif args.command == "diff":
            print(Plan.from_json(args.a).diff(Plan.from_json(args.b)))
        elif args.command == "code":
            print(_code(args))
        elif args.command == "coverage":
            names = args.models or [n for n in zoo.names() if n.endswith("-tiny")]
            rows = coverage(names, args.mesh, Options(device=args.device, training=args.training))
            print(report(rows, args.mesh, hand_ops=args.ops))
            return 1 if any(r.error for r in rows) else 0
        elif args.command == "sweep":
            return _sweep(args)
        elif args.command == "run":
            return _launch(args)
    except (AutoparError, ValueError, ImportError) as e:
        print(f"autopar: {e}", file=sys.stderr)
        return 1
    return 0


def _explained(plan: Plan, args) -> str:
    ops = [n.name for n in plan.nodes if n.kind is NodeKind.OP]
    if args.node not in {n.name for n in plan.nodes}:
        raise ValueError(f"plan {args.plan} has no node {args.node!r}; `python -m autopar show {args.plan} --nodes` "
                         f"lists them (ops: {', '.join(ops[:5])}{', ...' if len(ops) > 5 else ''})")
    return plan.explain(args.node)


def _code(args) -> str:
    model, margs, mkwargs = _built(args)
    traced = trace_for_planning(model, margs, mkwargs)
    mesh = Mesh.of(args.mesh)
    if not 0 <= args.rank < mesh.size:
        raise ValueError(f"--rank {args.rank} is not a rank of mesh {mesh.shape} (0..{mesh.size - 1})")
    if args.plan:
        plan = Plan.from_json(args.plan)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_traced(traced, mesh, Options(device=args.device, training=args.training, nodes=args.nnodes))[1]
    program = emit(traced, plan, mesh.coords(args.rank))
    return f"# rank {args.rank} at mesh coordinates {mesh.coords(args.rank)} of {mesh.shape}\n{program.code}"


if __name__ == "__main__":
    sys.exit(main())
