"""A plan over two nodes: two torchrun agents (here both on this machine, as two "nodes")
run 4 ranks each, the model is compiled with nodes=2, and the inter-node link is priced
slower than the intra-node one, so tensor parallelism belongs inside a node.

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 examples/two_nodes.py --out /tmp/two_nodes.json &
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 examples/two_nodes.py --out /tmp/two_nodes.json

Mesh (2, 4) over 2 nodes of 4 ranks (node-major): axis 1's groups {0..3} {4..7} stay
inside a node, axis 0's {0,4} {1,5} .. cross. Every rank checks its output and gradients
against the single-device model; rank 0 writes a JSON result (every rank's plan digest,
torchrun's node of each rank, the links the plan priced, the errors) for
tests/test_hierarchy.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _launch import launch, mesh_size  # noqa: E402
from torch import nn  # noqa: E402


def build(widths: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).train()


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import autopar
    from autopar import Link, LinkKind
    from autopar.core.placement import local_chunk
    from autopar.runtime.measure import calibrate
    torch.set_num_threads(1)
    widths = tuple(int(w) for w in args.widths.split(","))
    model, x = build(widths), torch.randn(args.batch, widths[0], generator=torch.Generator().manual_seed(1))
    reference = build(widths)
    intra = Link(10e-6, 1 / 10e9, "intra-fast")
    inter = Link(intra.alpha_s * args.inter_slowdown, intra.beta_s_per_byte * args.inter_slowdown, "inter-slow")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, (x,), mesh=tuple(int(s) for s in args.mesh.split(",")), nodes=args.nodes,
                             links={LinkKind.INTRA: intra, LinkKind.INTER: inter})
    out = pm(x)
    out.square().mean().backward()
    ref = reference(x)
    ref.square().mean().backward()
    grad_err = max((pm.shards.get_parameter(k).grad - local_chunk(r.grad, pm.state_specs[k], pm.mesh.shape, pm.coords))
                   .abs().max().item() for k, r in reference.named_parameters())
    mine = {"rank": rank, "node": int(os.environ.get("GROUP_RANK", "0")), "digest": pm.plan.digest(),
            "out_err": (out - ref).abs().max().item(), "grad_err": grad_err}
    if args.calibrate:  # each axis timed on this rank's own group of it: its own alpha and beta
        fits = calibrate(pm.comms, torch.device("cpu"), sizes=[4 << 10, 64 << 10], repeats=2,
                         kinds=pm.mesh.link_kinds(args.nodes))
        mine["calibrated"] = {k: {"ranks": f["ranks"], "link": f["link"], "alpha_s": f["alpha_s"]}
                              for k, f in fits.items()}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        result = {"world": world, "ranks": every, "links": [[a.kind.value, a.link.name] for a in pm.plan.links],
                  "placements": {n: p for n, p in pm.plan.placements().items() if n.endswith("weight")}}
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(args.out + ".tmp", args.out)  # the test never reads half a file
    # leave together: a rank tearing gloo down while a peer still has work in flight on
    # the same pair aborts the peer
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="rank 0 writes the JSON result here")
    p.add_argument("--mesh", default="2,4")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--inter-slowdown", type=float, default=20.0, help="inter-node alpha and beta over intra-node")
    p.add_argument("--widths", default="128,512,128,512,128")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--calibrate", action="store_true", help="also time small collectives on each axis's group")
    args = p.parse_args()
    launch(run, args, mesh_size(args.mesh), timeout_s=120)


if __name__ == "__main__":
    main()
