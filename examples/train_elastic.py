"""Elastic training that survives a lost rank or node: checkpoints every k steps, and
resumes from the newest complete one whenever it starts (torchrun's elastic agent restarts
the whole group after a worker dies, with however many nodes are left).

    torchrun --nproc-per-node 4 --max-restarts 1 examples/train_elastic.py --run-dir /tmp/run \\
        --steps 12 --every 4 --kill-rank 1 --kill-step 6

On a world that changes (--mesh auto: the planner picks the mesh of each attempt's world):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job examples/train_elastic.py \\
        --run-dir /tmp/run --mesh auto
    (the same on a second node, or in a second shell: two agents, 4 ranks. Kill one node's
    agent and workers and the survivors re-plan for 2 ranks and resume; a later launch on
    any number of ranks resumes from the newest checkpoint. torchrun can also take a
    returning node into the running job, but on torch 2.13 with both agents on one host
    that restart stalls in its rendezvous; tests/test_elastic.py grows back by a new launch)

With --kill-rank/--kill-step, that rank SIGKILLs itself between forward and backward of
that step, the first time only (a marker file in the run directory remembers it): the
other ranks are stuck in a collective until the agent stops them and restarts the group,
which resumes from the checkpoint at step 4 and runs steps 4..11 again. The final weights
equal an uninterrupted run's exactly (tests/test_resume.py checks it).

The model is a tiny GPT-2 or Llama from a transformers config (random weights, seed 0);
the data is steps x batch random sequences read in global batches by an
autopar.ElasticSampler, whose position the checkpoints record, so a resumed attempt (on
any world) reads the batches the lost one had not finished. Dropout is on, so the restored
per-rank RNG states matter. Rank 0 appends a line per attempt to <run-dir>/attempts.jsonl
and one per step to <run-dir>/steps.jsonl, and writes the final full state dict to
<run-dir>/final.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _launch import launch, mesh_size  # noqa: E402


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers as T
    torch.manual_seed(0)
    if args.model == "llama":
        config = T.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                               intermediate_size=2 * args.hidden, num_attention_heads=args.heads,
                               num_key_value_heads=args.heads,
                               vocab_size=args.vocab, max_position_embeddings=args.seq, attention_dropout=args.dropout,
                               use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return T.LlamaForCausalLM(config).train()
    config = T.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                          n_positions=args.seq, attn_pdrop=args.dropout, resid_pdrop=args.dropout,
                          embd_pdrop=args.dropout, use_cache=False, bos_token_id=0, eos_token_id=0)
    return T.GPT2LMHeadModel(config).train()


def dataset(args: argparse.Namespace) -> torch.Tensor:
    """One epoch of steps x batch sequences, the same on every rank and in every attempt."""
    g = torch.Generator().manual_seed(1_000_003 * args.data_seed)
    return torch.randint(1, args.vocab, (args.steps * args.batch, args.seq), generator=g)


def nodes_now() -> int:
    """The nodes (torchrun agents) of this attempt: fewer after a node is lost."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1"))


def mesh_of(args: argparse.Namespace):
    return "auto" if args.mesh == "auto" else tuple(int(x) for x in args.mesh.split(","))


def cost_preset(name: str):
    """A device preset name, or "cheap-comm": nearly free communication, so that even a
    model this small is planned sharded (collectives in every step, as at scale)."""
    if name == "cheap-comm":
        from autopar.tools.simulated import CHEAP_COMM
        return CHEAP_COMM
    return name


def maybe_die(rank: int, step: int, args: argparse.Namespace) -> None:
    """Kill this process mid-step, once per run directory (the marker stays)."""
    if rank != args.kill_rank or step != args.kill_step:
        return
    try:
        fd = os.open(os.path.join(args.run_dir, "killed.marker"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # the restarted attempt passes this step
    os.write(fd, f"rank {rank} killed itself at step {step}\n".encode())
    os.fsync(fd)
    os.close(fd)
    print(f"rank {rank}: SIGKILL at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def log_line(args: argparse.Namespace, name: str, **fields) -> None:
    fields["restart"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.path.join(args.run_dir, name), "a") as f:
        f.write(json.dumps(fields) + "\n")
    print(json.dumps(fields), flush=True)


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    import autopar
    torch.set_num_threads(1)
    root = os.path.join(args.run_dir, "checkpoints")
    data = dataset(args)
    sampler = autopar.ElasticSampler(len(data), args.batch, seed=args.data_seed)
    example = data[:args.batch]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # planned now: shard layouts must exist before resuming
        pm = autopar.compile(build_model(args), (), {"input_ids": example, "labels": example},
                             mesh=mesh_of(args), device=cost_preset(args.device), nodes=nodes_now())
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, eps=1e-6)
    # rank 0 picks the newest complete checkpoint; saved on another world it is resharded
    manifest = autopar.resume(pm, opt, root, data=sampler)
    start = manifest.step if manifest is not None else 0
    if rank == 0:
        print(pm.plan.summary(), flush=True)
        log_line(args, "attempts.jsonl", event="start", step=start, resumed=manifest is not None, world=world)
    for step in range(start, args.steps):
        indices = sampler.next_batch()
        ids = data[indices]
        loss = pm(input_ids=ids, labels=ids).loss
        maybe_die(rank, step, args)
        loss.backward()
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            log_line(args, "steps.jsonl", step=step, loss=loss.item(), world=world, batch=indices)
        if (step + 1) % args.every == 0:
            autopar.save_training_checkpoint(pm, opt, root, step + 1, keep=args.keep, data=sampler)
        time.sleep(args.step_sleep)
    full = pm.full_state_dict()
    if rank == 0:
        final = os.path.join(args.run_dir, "final.pt")
        torch.save(full, final + ".tmp")
        os.replace(final + ".tmp", final)  # a reader never sees half a file
        log_line(args, "attempts.jsonl", event="end", steps_run=args.steps - start, world=world)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="checkpoints, logs, the kill marker and final.pt go here")
    p.add_argument("--mesh", default="2,2", help='a mesh shape such as 2,2, or "auto" (the planner picks one '
                   "for each attempt's world)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn with --mesh auto outside torchrun")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to pause after each step")
    p.add_argument("--device", default="cheap-comm", help="cost-model preset to plan for (cpu, h100, ..., cheap-comm)")
    p.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4, help="checkpoint every k steps")
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep")
    p.add_argument("--kill-rank", type=int, default=-1, help="this rank kills itself (once) ...")
    p.add_argument("--kill-step", type=int, default=-1, help="... between forward and backward of this step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120, help="seconds a collective waits for a lost peer")
    return p


def main() -> None:
    args = parser().parse_args()
    os.makedirs(args.run_dir, exist_ok=True)
    world = args.nproc if args.mesh == "auto" else mesh_size(args.mesh)
    launch(run, args, world, timeout_s=args.timeout)  # under torchrun, or spawned here


if __name__ == "__main__":
    main()
