"""Analytic compute time of one op at its local shapes: a roofline,
max(FLOPs / achievable FLOP/s, bytes moved / memory bandwidth) + launch overhead."""

from __future__ import annotations

from math import prod
from typing import Any

import torch

from autopar.core.placement import TensorMeta
from autopar.cost_models.devices import DeviceSpec

aten = torch.ops.aten

MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
           aten.linear.default, aten.matmul.default}
# layout-only ops: no arithmetic and (in eager) usually no copy
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int,
         aten.permute.default, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
         aten.squeeze.dims, aten.expand.default, aten.slice.Tensor, aten.select.int, aten.split.Tensor,
         aten.alias.default, aten.detach.default}


def matmul_flops(inputs: tuple[TensorMeta, ...], outputs: tuple[TensorMeta, ...], target: Any) -> float:
    x = inputs[1] if target in (aten.addmm.default, aten.baddbmm.default) else inputs[0]
    k = x.shape[-1]
    return 2.0 * prod(outputs[0].shape) * k


def sdpa_flops(inputs: tuple[TensorMeta, ...]) -> float:
    q, k = inputs[0], inputs[1]
    b, h, l, e = q.shape
    s = k.shape[-2]
    return 4.0 * b * h * l * s * e


def flops(target: Any, inputs: tuple[TensorMeta, ...], outputs: tuple[TensorMeta, ...],
          score_share: float = 1.0) -> float:
    """`score_share`: of an attention's query-key pairs, the share its kernel computes
    (cost_models/attention.py)."""
    if target in MATMULS:
        return matmul_flops(inputs, outputs, target)
    if target == aten.scaled_dot_product_attention.default:
        return sdpa_flops(inputs) * score_share
    if target in VIEWS:
        return 0.0
    return float(sum(prod(o.shape) for o in outputs))


def bytes_moved(target: Any, inputs: tuple[TensorMeta, ...], outputs: tuple[TensorMeta, ...]) -> float:
    if target in VIEWS:
        return 0.0
    return float(sum(prod(m.shape) * m.dtype.itemsize for m in inputs + outputs))


def compute_s(device: DeviceSpec, target: Any, inputs: tuple[TensorMeta, ...],
              outputs: tuple[TensorMeta, ...], score_share: float = 1.0) -> float:
    if target in VIEWS:
        return 0.0
    dtype = (inputs or outputs)[0].dtype
    f = flops(target, inputs, outputs, score_share) / device.flops_per_s(dtype)
    b = bytes_moved(target, inputs, outputs) / device.mem_bw_bytes_per_s
    return max(f, b) + device.op_overhead_s


def backward_factor(target: Any, outputs: tuple[TensorMeta, ...]) -> float:
    """Backward work relative to forward: two matmuls per matmul, about one pass of the
    same bytes for everything else; integer and boolean results carry no gradient."""
    if not outputs or not outputs[0].dtype.is_floating_point:
        return 0.0
    return 2.0 if target in MATMULS or target == aten.scaled_dot_product_attention.default else 1.0
