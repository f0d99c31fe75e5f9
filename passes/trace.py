"""Stage 1: trace a model with torch.export into an ATen FX graph.

    model(*args, **kwargs)  ->  TracedGraph(gm, inputs, out_spec, fingerprint)

1. Flatten (args, kwargs) into tensor leaves; non-tensor leaves become constants of
   the trace (a different constant is a different signature).
2. torch.export the model behind a wrapper that takes only the tensor leaves, with
   transformers' KV cache switched off.
3. Read the graph signature: every placeholder is a parameter, buffer, constant or
   user input; refuse graphs that mutate inputs or buffers.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autopar import _compat
from autopar.core.errors import TraceError, UnsupportedModelError
from autopar.core.kinds import NodeKind
from autopar.core.placement import TensorMeta

@dataclass(frozen=True)
class GraphInput:
    """One placeholder: what feeds it (a state-dict key, a constant name, or the index
    of a tensor leaf of the flattened user inputs)."""

    name: str
    kind: NodeKind  # PARAMETER, BUFFER, CONSTANT or USER_INPUT
    target: Any
    meta: TensorMeta


@dataclass(frozen=True)
class TracedGraph:
    gm: fx.GraphModule
    inputs: tuple[GraphInput, ...]
    in_spec: Any  # pytree spec of (args, kwargs)
    out_spec: Any  # pytree spec of the model's output
    leaf_constants: tuple  # non-tensor leaves of the inputs, None where a tensor sits
    constants: dict  # lifted tensor constants by name
    fingerprint: str
    model_name: str
    training: bool
    input_paths: tuple[str, ...] = ()  # readable path of each tensor leaf: "kwargs['input_ids']"


class _TensorLeafCall(nn.Module):
    """Calls `model` from tensor leaves only, so export sees nothing but tensors."""

    def __init__(self, model: nn.Module, in_spec: Any, leaves: tuple) -> None:
        super().__init__()
        self.model = model
        self.in_spec = in_spec
        self.leaves = leaves

    def forward(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        leaves = [next(it) if leaf is None else leaf for leaf in self.leaves]
        args, kwargs = _compat.tree_unflatten(leaves, self.in_spec)
        return self.model(*args, **kwargs)


def flatten_inputs(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Any, tuple]:
    leaves, spec = _compat.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    consts = tuple(None if isinstance(x, torch.Tensor) else x for x in leaves)
    return tensors, spec, consts


def _no_kv_cache(model: nn.Module, kwargs: dict) -> dict:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    return kwargs


def trace(model: nn.Module, args: tuple = (), kwargs: dict | None = None) -> TracedGraph:
    kwargs = _no_kv_cache(model, dict(kwargs or {}))
    # 1. flatten
    tensors, in_spec, consts = flatten_inputs(args, kwargs)
    wrapper = _TensorLeafCall(model, in_spec, consts)
    name = type(model).__name__
    # 2. export
    try:
        ep = torch.export.export(wrapper, tuple(tensors), strict=False)
    except Exception as e:  # noqa: BLE001 - quote torch.export's reason, whatever its type
        reason = str(e).strip().splitlines()
        head = "\n".join(reason[:12])
        raise TraceError(
            f"torch.export could not trace model {name}: {type(e).__name__}: {head}\n"
            "autopar needs a model that torch.export.export(model, args, kwargs, strict=False) accepts; "
            "remove data-dependent Python control flow or pass example inputs that exercise one path.") from e
    # 3. in-place writes to intermediate values (masked_fill_, index_put_, a copy_ into a
    # slice) become functional ops (torch's functionalization): a sharded value that is
    # resharded before an in-place op would otherwise lose the write for its other readers
    if writes_intermediates(ep.graph_module):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch-internal pytree deprecation notes
            ep = ep.run_decompositions({})
    # 4. signature
    inputs = _rename_placeholders(ep.graph_module, _graph_inputs(ep, name))
    _refuse_input_writes(ep.graph_module, inputs, name)
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
    )


# torch.export InputKind name -> ours
_KIND = {"PARAMETER": NodeKind.PARAMETER, "BUFFER": NodeKind.BUFFER, "CONSTANT_TENSOR": NodeKind.CONSTANT,
         "USER_INPUT": NodeKind.USER_INPUT}


def _strip(target: str) -> str:
    return target[len("model."):] if target.startswith("model.") else target


def _graph_inputs(ep: Any, model_name: str) -> tuple[GraphInput, ...]:
    for spec in ep.graph_signature.output_specs:
        if spec.kind.name != "USER_OUTPUT":
            raise UnsupportedModelError(
                f"model {model_name} mutates {spec.target or spec.arg.name} in forward ({spec.kind.name}); "
                "autopar does not parallelise in-place updates of buffers or inputs yet. "
                "Call model.eval() (BatchNorm running stats) or make the update functional.")
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
    gm.recompile()
    return tuple(GraphInput(renamed.get(gi.name, gi.name), gi.kind, gi.target, gi.meta) for gi in inputs)


def written_args(node: fx.Node) -> list[fx.Node]:
    """Graph values an op writes in place, read from its schema's (a!) annotations."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node):
            out.append(value)
    return out


def writes_intermediates(gm: fx.GraphModule) -> bool:
    return any(w.op != "placeholder" for node in gm.graph.nodes if node.op == "call_function"
               for w in written_args(node))


def _refuse_input_writes(gm: fx.GraphModule, inputs: tuple[GraphInput, ...], model_name: str) -> None:
    """Each rank holds its own block of parameters, buffers and inputs, so an in-place
    update of one (BatchNorm's running statistics, a counter) would silently diverge."""
    by_name = {gi.name: gi for gi in inputs}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for value in written_args(node):
            gi = by_name.get(value.name)
            if gi is not None:
                from autopar.core.errors import describe_node
                what = gi.target if isinstance(gi.target, str) else f"input #{gi.target}"
                raise UnsupportedModelError(
                    f"model {model_name} mutates {gi.kind} {what} in place at {describe_node(node)}; "
                    "autopar does not parallelise in-place updates of parameters, buffers or inputs yet. "
                    "Call model.eval() (BatchNorm running statistics) or make the update functional.")


def fingerprint(gm: fx.GraphModule) -> str:
    """A hash of the graph's ops, wiring, shapes and dtypes: a plan made for another
    graph is refused rather than applied silently."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        dtype = str(val.dtype) if isinstance(val, torch.Tensor) else None
        h.update(repr((n.op, n.name, str(n.target), _arg_repr(n.args), shape, dtype)).encode())
    return h.hexdigest()[:16]


def _arg_repr(args: Any) -> Any:
    return fx.node.map_arg(args, lambda a: f"%{a.name}")
