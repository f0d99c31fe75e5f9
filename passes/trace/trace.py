"""Stage 1: trace a model with torch.export into an ATen FX graph.

    model(*args, **kwargs)  ->  TracedGraph(gm, inputs, out_spec, fingerprint)

1. Flatten (args, kwargs) into tensor leaves; non-tensor leaves (None included) become
   constants of the trace (a different constant is a different signature).
2. torch.export the model behind a wrapper that takes only the tensor leaves, with
   transformers' KV cache switched off while it runs (the user's config is restored).
3. Functionalise in-place writes to intermediate values and buffers
   (passes/trace/functionalize.py), with the functional copy that a slice write leaves spelled
   in differentiable ops.
4. Refuse sizes that depend on tensor values (x[mask], nonzero). Read the graph signature:
   every placeholder is a parameter, buffer, constant or user input; refuse graphs that
   write parameters or inputs. A write to a buffer is an
   extra output (first in the output tuple), recorded as a BufferUpdate: the runtime
   stores each rank's block of it after the call. Training batch norms become the ops
   of their definition, so a batch split synchronises statistics (SyncBatchNorm).
5. An explicit mask proven causal becomes sdpa's is_causal (passes/trace/causal_masks.py);
   a mean loss becomes its sum over its count (passes/trace/mean_losses.py).
   Canonical order and names (passes/trace/canonical.py); each mixture-of-experts routing
   becomes one routed_experts node (passes/trace/experts.py), canonical again after.

Steps 1-3 are export_program, 4-5 traced_program; program_bytes and load_program carry a program
between processes in between (runtime/shipping.py: one rank traces, every rank plans its graph).
"""

from __future__ import annotations

import hashlib
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator, Optional

import torch
from torch import fx, nn

from autopar import _compat
from autopar.core.errors import TraceError, UnsupportedModelError, describe_node
from autopar.core.kinds import NodeKind
from autopar.core.log import logged
from autopar.core.placement import TensorMeta, size_hint
from autopar.passes.trace.dynamic import SymbolicDim, specialised_error, symbolic_dims
from autopar.passes.trace.functionalize import differentiable_copies, needs_functionalising, sync_batch_norms, written_args
from autopar.passes.trace.canonical import canonicalise
from autopar.passes.trace.causal_masks import causal_masks_to_is_causal
from autopar.passes.trace.mean_losses import mean_losses_as_sums
from autopar.passes.trace.custom_grad import backward_differs, custom_functions_applied
from autopar.passes.trace.experts import collapse_routed_experts
from autopar.passes.trace.higher_order import inline_grad_regions

@dataclass(frozen=True)
class GraphInput:
    """One placeholder: what feeds it (a state-dict key, a constant name, or the index
    of a tensor leaf of the flattened user inputs)."""

    name: str
    kind: NodeKind  # PARAMETER, BUFFER, CONSTANT or USER_INPUT
    target: Any
    meta: TensorMeta


@dataclass(frozen=True)
class BufferUpdate:
    """Graph output `index` is the new value of buffer `target` (torch.export's BUFFER_MUTATION
    output): each rank stores its block of it, in the layout of its placeholder `placeholder`."""

    index: int
    target: str  # state-dict name
    placeholder: str


@dataclass(frozen=True)
class TracedGraph:
    gm: fx.GraphModule
    inputs: tuple[GraphInput, ...]
    in_spec: Any  # pytree spec of (args, kwargs)
    out_spec: Any  # pytree spec of the model's output
    leaf_constants: tuple  # non-tensor leaves of the inputs, Leaf.TENSOR where a tensor sits
    constants: dict  # lifted tensor constants by name
    fingerprint: str
    model_name: str
    training: bool
    input_paths: tuple[str, ...] = ()  # readable path of each tensor leaf: "kwargs['input_ids']"
    buffer_updates: tuple[BufferUpdate, ...] = ()  # graph outputs that are new buffer values
    symbolic: tuple[SymbolicDim, ...] = ()  # symbolic input dims (passes/trace/dynamic.py); () when static

    @property
    def updated_positions(self) -> frozenset[int]:  # program outputs that are new buffer values
        return frozenset(u.index for u in self.buffer_updates)

    def user_outputs(self, outputs: Any) -> list:
        """The model's own output leaves among the program's outputs (its out_spec's)."""
        updated = self.updated_positions
        return _compat.tree_flatten([o for i, o in enumerate(outputs) if i not in updated])[0]

    def updated_buffers(self, outputs: Any) -> dict:
        """The program's new value of each buffer it writes, by state-dict name."""
        return {u.target: outputs[u.index] for u in self.buffer_updates}


class Leaf(Enum):
    """Marks where a tensor sits among the inputs' constant leaves (a None leaf is an input's own)."""

    TENSOR = "tensor"


class _TensorLeafCall(nn.Module):
    """Calls `model` from tensor leaves only, so export sees nothing but tensors.

    With a `param_dtype` (mixed precision, as FSDP2's MixedPrecisionPolicy) the model runs
    on copies of its floating parameters and inputs in that dtype, and its floating
    outputs come back in the parameters' own dtype: the casts are ops of the traced graph,
    so the planner prices them (it may gather the cheap copies instead of the masters)
    and autograd returns gradients to the full-precision parameters (the masters)."""

    def __init__(self, model: nn.Module, in_spec: Any, leaves: tuple,
                 param_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.model = model
        self.in_spec = in_spec
        self.leaves = leaves
        self.param_dtype = param_dtype

    def forward(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        leaves = [next(it) if leaf is Leaf.TENSOR else leaf for leaf in self.leaves]
        args, kwargs = _compat.tree_unflatten(leaves, self.in_spec)
        if self.param_dtype is None:
            return self.model(*args, **kwargs)
        low = self.param_dtype
        masters = dict(self.model.named_parameters())
        out_dtype = next((p.dtype for p in masters.values() if p.is_floating_point()), torch.float32)
        copies = {k: p.to(low) if p.is_floating_point() else p for k, p in masters.items()}
        args, kwargs = cast_floating((args, kwargs), low)
        out = torch.func.functional_call(self.model, copies, args, kwargs, tie_weights=True, strict=False)
        return cast_floating(out, out_dtype)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """The floating tensors of a tree in `dtype`, everything else as it is."""
    leaves, spec = _compat.tree_flatten(tree)
    return _compat.tree_unflatten([x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                                   for x in leaves], spec)


def flatten_inputs(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Any, tuple]:
    leaves, spec = _compat.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    consts = tuple(Leaf.TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
    return tensors, spec, consts


@contextmanager
def kv_cache_off(model: nn.Module) -> Iterator[None]:
    """transformers' `use_cache = False` while tracing, on every config the model holds (a
    multimodal model's text config, a submodule's own config: a cache object in the
    outputs is something torch.export cannot return); the user's values after."""
    configs = _configs(model)
    before = [(c, c.use_cache) for c in configs]
    try:
        for c, _ in before:
            c.use_cache = False
        yield
    finally:
        for c, value in before:
            c.use_cache = value


def _configs(model: nn.Module) -> list[Any]:
    """Every transformers config reachable from the model's modules and their sub-configs
    (attributes that are configs themselves: text_config, decoder, ...) with a use_cache."""
    found: dict[int, Any] = {}
    stack = [c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None]
    while stack:
        config = stack.pop()
        if id(config) in found:
            continue
        found[id(config)] = config
        stack.extend(v for v in getattr(config, "__dict__", {}).values() if callable(getattr(v, "to_dict", None)))
    return [c for c in found.values() if isinstance(getattr(c, "use_cache", None), bool)]


@logged("trace", lambda t: f"{t.model_name}, {len(t.gm.graph.nodes)} nodes")
def trace(model: nn.Module, args: tuple = (), kwargs: dict | None = None,
          param_dtype: Optional[torch.dtype] = None, dynamic_shapes: Optional[tuple] = None) -> TracedGraph:
    """`param_dtype`: run on copies of the floating parameters and inputs in this dtype
    (mixed precision; see _TensorLeafCall). `dynamic_shapes`: torch.export's, for the
    wrapper's tensor leaves (passes/trace/dynamic.py export_shapes)."""
    kwargs = dict(kwargs or {})
    return traced_program(export_program(model, args, kwargs, param_dtype, dynamic_shapes), model, args, kwargs)


def export_program(model: nn.Module, args: tuple = (), kwargs: dict | None = None,
                   param_dtype: Optional[torch.dtype] = None, dynamic_shapes: Optional[tuple] = None) -> Any:
    """Steps 1-3: the ExportedProgram of `model` on these inputs, in-place writes to
    intermediate values functionalised (what traced_program reads)."""
    # 1. flatten
    tensors, in_spec, consts = flatten_inputs(args, dict(kwargs or {}))
    wrapper = _TensorLeafCall(model, in_spec, consts, param_dtype)
    name = type(model).__name__
    # 2. export, always with gradients on: the caller's grad mode must not shape the
    # program (under no_grad torch picks other kernels, whose outputs' strides drop a
    # `contiguous` from the graph), or a plan made in one mode fails in the other
    try:
        with torch.enable_grad(), kv_cache_off(model), custom_functions_applied() as custom:
            ep = torch.export.export(wrapper, tuple(tensors), dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # noqa: BLE001 - quote torch.export's reason, whatever its type
        if dynamic_shapes is not None and "Constraints violated" in str(e):
            raise specialised_error(name, dynamic_shapes, e) from e
        reason = str(e).strip().splitlines()
        head = "\n".join(reason[:12])
        raise TraceError(
            f"torch.export could not trace model {name}: {type(e).__name__}: {head}\n"
            "autopar needs a model that torch.export.export(model, args, kwargs, strict=False) accepts; "
            "remove data-dependent Python control flow or pass example inputs that exercise one path.") from e
    inexact = [a.name for a in custom if model.training and backward_differs(a)]
    if inexact:
        raise TraceError(
            f"model {name} applies custom autograd.Function {', '.join(inexact)} while training, whose backward is "
            "not the derivative of its forward (checked on random inputs): torch.export records only a Function's "
            "forward, so the trace's gradients would not be the model's. Plan it for inference (model.eval()), "
            "or replace the Function by ordinary differentiable ops.")
    # 3. in-place writes to intermediate values (masked_fill_, index_put_, a copy_ into a
    # slice) become functional ops (torch's functionalization): a sharded value that is
    # resharded before an in-place op would otherwise lose the write for its other readers;
    # writes to buffers become outputs
    inline_grad_regions(ep.graph_module)  # `with torch.no_grad():` inside forward, before the write checks
    buffers = {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "BUFFER"}
    if needs_functionalising(ep.graph_module, buffers):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch-internal pytree deprecation notes
            ep = ep.run_decompositions({})
        differentiable_copies(ep.graph_module)
    return ep


def traced_program(ep: Any, model: nn.Module, args: tuple = (), kwargs: dict | None = None) -> TracedGraph:
    """Steps 4-5: the TracedGraph of `export_program(model, args, kwargs)`'s program `ep`
    (from this process or, through load_program, from another rank). Renames `ep`'s
    placeholders in place, so serialise it (program_bytes) before this."""
    kwargs = dict(kwargs or {})
    _, in_spec, consts = flatten_inputs(args, kwargs)
    name = type(model).__name__
    # 4. signature
    _refuse_value_sized(ep.graph_module, name)
    inputs = _graph_inputs(ep, name)
    users = sorted((gi.target, gi.name) for gi in inputs if gi.kind is NodeKind.USER_INPUT)
    symbolic = symbolic_dims(ep.graph_module, [n for _, n in users], ep.range_constraints)
    updates = _buffer_updates(ep, inputs, name)
    sync_batch_norms(ep.graph_module)
    inputs = _rename_placeholders(ep.graph_module, inputs)
    causal_masks_to_is_causal(ep.graph_module)
    mean_losses_as_sums(ep.graph_module)
    canonicalise(ep.graph_module.graph)
    # routings found in canonical order; canonical again after, as a stretched graph is (stretch.py)
    if collapse_routed_experts(ep.graph_module):
        canonicalise(ep.graph_module.graph)
    ep.graph_module.recompile()
    renamed = {gi.target: gi.name for gi in inputs if gi.kind is NodeKind.BUFFER}
    return TracedGraph(
        gm=ep.graph_module,
        inputs=inputs,
        in_spec=in_spec,
        out_spec=ep.call_spec.out_spec,
        leaf_constants=consts,
        constants={_strip(k): v for k, v in ep.constants.items()},
        fingerprint=fingerprint(ep.graph_module),
        model_name=name,
        training=model.training,
        input_paths=_compat.tensor_leaf_paths((tuple(args), dict(kwargs))),
        buffer_updates=tuple(BufferUpdate(i, target, renamed[target]) for i, target in updates),
        symbolic=symbolic,
    )


# torch.export InputKind name -> ours
_KIND = {"PARAMETER": NodeKind.PARAMETER, "BUFFER": NodeKind.BUFFER, "CONSTANT_TENSOR": NodeKind.CONSTANT,
         "USER_INPUT": NodeKind.USER_INPUT}


def _strip(target: str) -> str:
    return target[len("model."):] if target.startswith("model.") else target


def _graph_inputs(ep: Any, model_name: str) -> tuple[GraphInput, ...]:
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    user_index = 0
    for spec in ep.graph_signature.input_specs:
        kind = _KIND.get(spec.kind.name)
        node = placeholders[spec.arg.name]
        val = node.meta.get("val")
        if kind is None or not isinstance(val, torch.Tensor):
            raise UnsupportedModelError(
                f"model {model_name}: graph input {spec.arg.name} is a {spec.kind.name}, "
                "which autopar cannot feed; pass tensors as inputs")
        if kind is NodeKind.USER_INPUT:
            target: Any = user_index
            user_index += 1
        else:
            target = _strip(spec.target)
        out.append(GraphInput(spec.arg.name, kind, target, TensorMeta.of(val)))
    return tuple(out)


def _rename_placeholders(gm: fx.GraphModule, inputs: tuple[GraphInput, ...]) -> tuple[GraphInput, ...]:
    """'p_model_lm_head_weight' -> 'p_lm_head_weight': drop the wrapper's attribute name;
    user inputs are named after their position ('tensors_0' -> 'input_0')."""
    taken = {n.name for n in gm.graph.nodes}
    renamed = {}
    for gi in inputs:
        new = gi.name
        for prefix in ("p_model_", "b_model_", "c_model_"):
            if gi.name.startswith(prefix):
                new = prefix[:2] + gi.name[len(prefix):]
        if gi.kind is NodeKind.USER_INPUT and gi.name.startswith("tensors"):
            new = f"input_{gi.target}"
        if new != gi.name and new not in taken:
            taken.add(new)
            renamed[gi.name] = new
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in renamed:
            node.name = node.target = renamed[node.name]
    # no recompile here: canonicalise, which runs next, renames again and recompiles once
    return tuple(GraphInput(renamed.get(gi.name, gi.name), gi.kind, gi.target, gi.meta) for gi in inputs)


def _refuse_value_sized(gm: fx.GraphModule, model_name: str) -> None:
    """A TraceError at the first op whose output size depends on tensor values (boolean
    masking, nonzero, unique) with no size for the planner to price it at: every rank's
    block of it would have its own size."""
    unknown = _compat.data_dependent_error()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        try:
            for size in val.shape:
                size_hint(size)
        except unknown:
            raise TraceError(
                f"model {model_name}: {describe_node(node)} makes a tensor of shape {tuple(val.shape)} whose size "
                "depends on tensor values (boolean masking, nonzero, unique), which autopar cannot split or price; "
                "keep the shape fixed (torch.where(mask, x, 0) instead of x[mask]) or move that op out of the "
                "model's forward") from None


def _buffer_updates(ep: Any, inputs: tuple[GraphInput, ...], model_name: str) -> list[tuple[int, str]]:
    """(output index, buffer state-dict name) of each output that updates a buffer.
    Each rank holds its own block of parameters and inputs, so an in-place update of one
    would silently diverge: refused. A write shows as an op that writes a placeholder in
    place or, where step 3 functionalised the graph, as an output that updates one; step 3
    functionalises every write to a buffer, so buffers show only as outputs."""
    by_name = {gi.name: gi for gi in inputs}
    by_target = {gi.target: gi for gi in inputs if isinstance(gi.target, str)}
    writes = [(node, _state_name(by_name[value.name])) for node in ep.graph.nodes if node.op == "call_function"
              for value in written_args(node) if value.name in by_name]
    nodes = {n.name: n for n in ep.graph.nodes}
    updates = []
    for i, spec in enumerate(ep.graph_signature.output_specs):
        if spec.kind.name == "USER_OUTPUT":
            continue
        gi = by_name.get(spec.target) or by_target.get(_strip(spec.target or ""))
        if spec.kind.name == "BUFFER_MUTATION" and gi is not None and gi.kind is NodeKind.BUFFER:
            updates.append((i, gi.target))
        else:
            writes.append((nodes[spec.arg.name], _state_name(gi) if gi else f"{spec.target} ({spec.kind.name})"))
    if writes:
        node, what = writes[0]
        raise UnsupportedModelError(
            f"model {model_name} mutates {what} in place at {describe_node(node)}; "
            "autopar parallelises in-place updates of buffers, not of parameters or inputs: "
            "make the update functional (return the new value) or keep that tensor as a buffer.")
    return updates


def _state_name(gi: GraphInput) -> str:
    """'buffer bn.running_mean', 'user_input input #0'."""
    return f"{gi.kind} {gi.target}" if isinstance(gi.target, str) else f"{gi.kind} input #{gi.target}"


def fingerprint(gm: fx.GraphModule) -> str:
    """A hash of the graph's ops, wiring, arguments, shapes and dtypes: a plan made for another
    graph is refused rather than applied silently."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        dtype = str(val.dtype) if isinstance(val, torch.Tensor) else None
        h.update(repr((n.op, n.name, str(n.target), _arg_repr(n.args), _arg_repr(n.kwargs), shape, dtype)).encode())
    return h.hexdigest()[:16]


def _arg_repr(args: Any) -> Any:
    """Arguments with nodes by name and devices left out (a plan made on the meta device,
    or on cuda:0, is for every rank's device)."""
    leaves, spec = _compat.tree_flatten(fx.node.map_arg(args, lambda a: f"%{a.name}"))
    return _compat.tree_unflatten(["<device>" if isinstance(x, torch.device) else x for x in leaves], spec)
