"""Uneven splits of attention heads (issue #15 item 2): a dim cut in whole heads,
Shard(d, unit) printed S(d/u), chunks the n / u heads as torch.chunk does, so 5 heads of
16 over 2 ranks are 48 and 32 columns (not chunk(80, 2)).

1. Block sizes, spec strings, canonical (even) forms (pure).
2. Reshard steps between units, and their units restored from the target spec.
The simulator and gloo cases are in tests/test_uneven.py (CASES "llama-heads5-*", one
spawn); the helpers they use live here.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch

from autopar.core.kinds import StepKind
from autopar.core.placement import (R, Shard, Spec, TensorMeta, block_index, canonical, chunk_sizes, local_chunk,
                                   parse_placement, parse_placements)
from autopar.tools import zoo

F32 = torch.float32


# ---- 1. blocks in whole heads --------------------------------------------------------------

def test_blocks_in_whole_heads():
    """S(d/u): the n / u heads are chunked, each block a whole number of heads."""
    assert chunk_sizes(80, 2, 16) == (48, 32) and chunk_sizes(320, 2, 64) == (192, 128)
    assert chunk_sizes(56, 4, 8) == (16, 16, 16, 8) and chunk_sizes(64, 2, 16) == chunk_sizes(64, 2)
    spec = Spec((R, Shard(1, 16)), TensorMeta((3, 80), F32))
    assert str(spec) == "RS(1/16)" and parse_placements(str(spec)) == spec.placements
    assert parse_placement("S(1/16)") == Shard(1, 16) and parse_placement("S(1)") == Shard(1)
    with pytest.raises(ValueError):
        parse_placement("S(1/0)")
    assert spec.fits((1, 2), uneven=True) and not spec.fits((1, 2)) and spec.uneven_axes((1, 2)) == (1,)
    assert spec.local_shape((1, 2)) == (3, 48) and spec.local_shape_at((1, 2), (0, 1)) == (3, 32)
    assert block_index(spec, (1, 2), (0, 1)) == (slice(0, 3), slice(48, 80))
    full = torch.randn(3, 80)
    torch.testing.assert_close(local_chunk(full, spec, (1, 2), (0, 1)), full[:, 48:])
    assert not Spec((Shard(1, 16),), TensorMeta((3, 90), F32)).fits((2,), uneven=True)  # 90 is no whole heads
    # an even split never carries a unit: 4 heads over 2 (or 5 over 5) is S(d)
    assert canonical((Shard(1, 16),), (3, 64), (2,)) == (Shard(1),)
    assert canonical((Shard(1, 16),), (3, 80), (5,)) == (Shard(1),)
    assert canonical((Shard(1, 16),), (3, 80), (2,)) == (Shard(1, 16),)


# ---- 2. resharding in whole heads --------------------------------------------------------

def test_reshard_between_units_gathers_and_recuts():
    """Blocks of whole heads are not chunks of the dim: S(0/16) -> S(0) regathers, and a
    plan file's steps (no units) get them back from the target spec."""
    from autopar.core.resharding import reshard_steps, with_units
    meta = TensorMeta((80, 3), F32)
    heads = Spec((Shard(0, 16),), meta)
    steps = reshard_steps(heads, Spec((Shard(0),), meta))
    assert [(s.kind, s.from_unit, s.unit) for s in steps] == [(StepKind.ALL_GATHER, 16, 1), (StepKind.SLICE, 1, 1)]
    cut = reshard_steps(Spec((R,), meta), heads)
    assert [(s.kind, s.unit) for s in cut] == [(StepKind.SLICE, 16)]
    stored = tuple(dataclasses.replace(s, unit=1) for s in cut)  # as a plan file has it
    assert with_units(stored, heads) == cut and [str(s) for s in stored] == [str(s) for s in cut]
    assert reshard_steps(heads, heads) == ()


# ---- helpers of tests/test_uneven.py's head cases ------------------------------------------

def in_heads(spec: Spec, mesh_shape: tuple[int, ...]) -> bool:
    """Attention split by head: a 4-D activation split unevenly (5 heads over 2), or an
    attention weight of hidden x hidden cut in whole heads of 16."""
    return bool(spec.uneven_axes(mesh_shape)) and (
        spec.meta.ndim == 4 or (spec.meta.shape == (80, 80) and any(p.unit == 16 for p in spec.placements
                                                                     if type(p) is Shard)))


def in_units(spec: Spec, mesh_shape: tuple[int, ...]) -> bool:
    """Any tensor cut in whole heads or split unevenly: norms, MLP and embedding too, so
    values move between P, S(d/16), S(d) and R in whole heads."""
    return bool(spec.uneven_axes(mesh_shape))


def llama_heads5():
    """5 heads of 16 (hidden 80): 3 and 2 heads on 2 ranks, i.e. 48 and 32 columns."""
    return zoo.build("llama-tiny", batch=2, seq=8, training=True, hidden_size=80, num_attention_heads=5,
                     num_key_value_heads=5, num_hidden_layers=1)


def head_split_weights(plan) -> dict[str, str]:
    """Attention projection weights the plan cuts in whole heads (S(d/16))."""
    return {n.name: str(n.outputs[0]) for n in plan.nodes if n.op == "placeholder" and "attn" in n.name
            and "/16)" in str(n.outputs[0])}


def through_json(plan):
    """The plan written to a file and read back (a unit round-trips; steps are re-stamped)."""
    from autopar.core.plan import Plan
    with tempfile.TemporaryDirectory() as tmp:
        plan.to_json(os.path.join(tmp, "plan.json"))
        loaded = Plan.from_json(os.path.join(tmp, "plan.json"))
    assert [(n.name, n.inputs, n.outputs) for n in loaded.nodes] == [(n.name, n.inputs, n.outputs) for n in plan.nodes]
    return loaded


def heads_state(pm, rank: int) -> dict:
    """load_full_state_dict and safetensors into blocks of whole heads read back; a DCP
    checkpoint (which saves such blocks whole along their axis) and a training checkpoint
    with Adam's moments come back into the same blocks."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from autopar.runtime.resume import resume, save_training_checkpoint
    from autopar.runtime.state import full_state_dict, gather_full
    shifted = {k: v + 1 for k, v in full_state_dict(pm).items()}
    buffers = {k: gather_full(pm.state_tensors[k], s, pm) for k, s in pm.state_specs.items() if k not in shifted}
    pm.load_full_state_dict({**shifted, **buffers})  # with the non-persistent rotary buffers
    after_load = full_state_dict(pm)
    tmp = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(tmp)
    path = os.path.join(tmp[0], "heads.safetensors")
    if rank == 0:
        save_file({**{k: v * 2 for k, v in shifted.items()}, **{k: v.contiguous() for k, v in buffers.items()}}, path)
    dist.barrier()
    pm.load_safetensors(path)
    after_safetensors = full_state_dict(pm)
    pm.save_checkpoint(os.path.join(tmp[0], "ckpt"))
    pm.load_full_state_dict({**{k: torch.zeros_like(v) for k, v in shifted.items()}, **buffers})
    pm.load_checkpoint(os.path.join(tmp[0], "ckpt"))
    after_dcp = full_state_dict(pm)
    opt = torch.optim.Adam(pm.parameters(), lr=0.01)
    args, kwargs = llama_heads5()[1:]
    for step in range(2):  # the second step moves weights and moments on; resume must bring both back
        pm(*args, **kwargs).logits.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            saved = full_state_dict(pm)
            moments = [opt.state[p]["exp_avg"].clone() for p in pm.parameters()]
            save_training_checkpoint(pm, opt, os.path.join(tmp[0], "train"), step=1)
    resume(pm, opt, os.path.join(tmp[0], "train"))
    return {"shifted": shifted, "after_load": after_load, "after_safetensors": after_safetensors,
            "after_dcp": after_dcp, "saved": saved, "resumed": full_state_dict(pm),
            "moments_equal": all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(pm.parameters(), moments)),
            "local_q": tuple(pm.state_tensors["model.layers.0.self_attn.q_proj.weight"].shape)}
