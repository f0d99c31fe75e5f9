"""Every private or version-dependent torch API autopar touches, in one place, so a
torch upgrade (2.11 -> 2.13 and on) is one file's problem."""

from __future__ import annotations

import faulthandler
from typing import Any

import torch
import torch.utils._pytree as _pytree


def tree_flatten(tree: Any) -> tuple[list, Any]:
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec: Any) -> Any:
    return _pytree.tree_unflatten(leaves, spec)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """Sum `input` over the group, keep this rank's chunk of dim 0 in `output`.
    torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single."""
    import torch.distributed as dist
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, group=group)


def tensor_leaf_paths(tree: Any) -> tuple[str, ...]:
    """'args[0]', "kwargs['input_ids']" for each tensor leaf of (args, kwargs)."""
    flat, _ = _pytree.tree_flatten_with_path(tree)
    out = []
    for path, leaf in flat:
        if isinstance(leaf, torch.Tensor):
            text = _pytree.keystr(path)  # e.g. "[0][0]" or "[1]['input_ids']"
            head, rest = ("args", text[3:]) if text.startswith("[0]") else ("kwargs", text[3:])
            out.append(head + rest)
    return tuple(out)


def backend_compiler_failed() -> type:
    """The exception torch.compile raises when its backend (Inductor) fails to compile."""
    from torch._dynamo.exc import BackendCompilerFailed
    return BackendCompilerFailed


def queue_backward_callback(fn: Any) -> None:
    """Run fn once the current backward pass has finished (the hook DDP's reducer uses)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def dispatch_mode() -> type:
    """torch's TorchDispatchMode (a private module): the base of a mode that sees every
    op's inputs and outputs (autopar/tools/memory_meter.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    return TorchDispatchMode


def fake_mode() -> Any:
    """A fresh FakeTensorMode (a private module): tensors with shapes and no data
    (passes/trace/saved.py runs a graph on them to see what autograd saves)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=True)


def rename_nodes(graph: Any, candidates: dict) -> None:
    """Rename `graph`'s FX nodes in graph order, each from its candidate in `candidates`
    (node -> str; its own name where absent), through a namespace rebuilt for the graph
    (FX's private torch.fx.graph._Namespace), which numbers repeats (`linear`, `linear_1`)
    and avoids builtins (`sum` -> `sum_1`) as FX's tracer does."""
    from torch.fx.graph import _Namespace

    namespace = _Namespace()
    for node in graph.nodes:
        node.name = namespace.create_name(candidates.get(node, node.name), node)
    graph._graph_namespace = namespace


def data_dependent_error() -> type:
    """The error torch raises when a size depends on tensor values it does not know
    (an unbacked symbol such as the row count of `x[x > 0]` or `nonzero`)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    return GuardOnDataDependentSymNode


def report_fatal_signals() -> None:
    """A process killed by SIGSEGV, SIGABRT, SIGBUS, SIGILL or SIGFPE prints where every
    thread was: Python frames (faulthandler) and native ones, gloo's worker threads
    included (c10's fatal-signal handler, where this torch has it). For rank processes
    that autopar's tests, examples and sweep start: a crash in C++ then names its frame."""
    faulthandler.enable(all_threads=True)
    native = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if native is not None:
        native(True)
