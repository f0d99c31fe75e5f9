"""Plans as JSON files: a documented, versioned schema, atomic writes, validating loads.

Schema version 1 (keys of the top-level object):

    schema            "autopar.plan"
    schema_version    1
    autopar_version   version that wrote the file
    torch_version     torch that traced the model
    model             model class name
    fingerprint       hash of the traced graph (ops, wiring, shapes, dtypes); a plan is only
                      applied to a model whose trace has the same fingerprint
    mesh              [axis sizes]
    training          whether backward work was planned for
    device            cost-model preset or profile name
    predicted         {compute_s, comm_s, param_bytes, activation_bytes, state_bytes, memory_bytes}: per rank
    solver            {solver, status, objective_s, gap, solve_time_s, variables, constraints, groups,
                       shared_blocks (absent in older files: 0)}
    unruled_ops       ops replicated for want of a rule
    discovered_ops    ops sharded by rules found by experiment (absent in older files)
    cost_note         where the costs came from (preset, or profile and its missing timings)
    nodes             [{name, op, module, group, inputs: [spec], outputs: [spec], compute_s,
                        alternatives, options: [{inputs: ["S(0)R", ..], outputs: [..], compute_s,
                        reshard_in_s, reshard_out_s}]}]  (option placements over the node's metas)
    edges             [{producer, index, consumer, position, comm_s, steps: [step]}]
    collectives       [{kind, axis, nbytes, producer, consumer, backward}]: forward order, for readers
    spec              {placements: ["S(0)", "R"], shape: [..], dtype: "float32"}
    step              {kind, axis, dim, to_dim, reduce, backward, before: spec}
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch

from autopar.errors import AutoparError
from autopar.mesh import Mesh
from autopar.placement import Spec, TensorMeta, parse_placement, parse_placements
from autopar.plan import Alternative, EdgePlan, NodeChoice, Plan, SolverReport
from autopar.resharding import Step

SCHEMA = "autopar.plan"
SCHEMA_VERSION = 1


class PlanFileError(AutoparError, ValueError):
    """A plan file is unreadable, of another schema version, or for another model."""


def spec_to_json(spec: Spec) -> dict:
    return {"placements": [str(p) for p in spec.placements], "shape": list(spec.meta.shape),
            "dtype": str(spec.meta.dtype).removeprefix("torch.")}


def spec_from_json(d: dict) -> Spec:
    dtype = getattr(torch, d["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {d['dtype']!r}")
    return Spec(tuple(parse_placement(p) for p in d["placements"]), TensorMeta(tuple(d["shape"]), dtype))


def _step_to_json(s: Step) -> dict:
    return {"kind": s.kind, "axis": s.axis, "dim": s.dim, "to_dim": s.to_dim, "reduce": s.reduce,
            "backward": s.backward, "before": spec_to_json(s.before) if s.before is not None else None}


def _step_from_json(d: dict) -> Step:
    return Step(d["kind"], d["axis"], d["dim"], d["to_dim"], d["reduce"], d["backward"],
                spec_from_json(d["before"]) if d["before"] is not None else None)


def plan_to_dict(plan: Plan) -> dict:
    from autopar import __version__
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "autopar_version": __version__,
        "torch_version": torch.__version__, "model": plan.model_name, "fingerprint": plan.fingerprint,
        "mesh": list(plan.mesh.shape), "training": plan.training, "device": plan.device,
        "predicted": {"compute_s": plan.compute_s, "comm_s": plan.comm_s, "param_bytes": plan.param_bytes,
                      "activation_bytes": plan.activation_bytes, "state_bytes": plan.state_bytes,
                      "memory_bytes": plan.memory_bytes},
        "solver": vars(plan.solver).copy() if hasattr(plan.solver, "__dict__") else _fields(plan.solver),
        "unruled_ops": list(plan.unruled_ops), "discovered_ops": list(plan.discovered_ops),
        "cost_note": plan.cost_note,
        "nodes": [{"name": n.name, "op": n.op, "module": n.module, "group": n.group,
                   "inputs": [spec_to_json(s) for s in n.inputs], "outputs": [spec_to_json(s) for s in n.outputs],
                   "compute_s": n.compute_s, "alternatives": n.alternatives,
                   "options": [{"inputs": [str(s) for s in a.inputs],
                                "outputs": [str(s) for s in a.outputs], "compute_s": a.compute_s,
                                "reshard_in_s": a.reshard_in_s, "reshard_out_s": a.reshard_out_s}
                               for a in n.options]}
                  for n in plan.nodes],
        "edges": [{"producer": e.producer, "index": e.index, "consumer": e.consumer, "position": e.position,
                   "comm_s": e.comm_s, "steps": [_step_to_json(s) for s in e.steps]} for e in plan.edges],
        "collectives": [_fields(c) for c in plan.collectives()],
    }


def _fields(obj: Any) -> dict:
    from dataclasses import asdict
    return asdict(obj)


def plan_from_dict(d: dict, source: str = "<dict>") -> Plan:
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise PlanFileError(f"{source} is not an autopar plan (no \"schema\": \"{SCHEMA}\" field)")
    version = d.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanFileError(f"{source} has plan schema version {version!r}; this autopar reads version "
                            f"{SCHEMA_VERSION}. Re-plan with this version (python -m autopar plan ...)")
    try:
        nodes = tuple(NodeChoice(
            n["name"], n["op"], tuple(map(spec_from_json, n["inputs"])), tuple(map(spec_from_json, n["outputs"])),
            float(n["compute_s"]), int(n["alternatives"]), n.get("module", ""),
            _options(n), n.get("group", "")) for n in d["nodes"])
        edges = tuple(EdgePlan(e["producer"], e["index"], e["consumer"], e["position"],
                               tuple(map(_step_from_json, e["steps"])), float(e["comm_s"])) for e in d["edges"])
        p = d["predicted"]
        return Plan(Mesh(tuple(d["mesh"])), d["model"], d["fingerprint"], bool(d["training"]), d["device"], nodes,
                    edges, float(p["compute_s"]), float(p["comm_s"]), int(p["param_bytes"]),
                    int(p["activation_bytes"]), SolverReport(**d["solver"]), tuple(d.get("unruled_ops", ())),
                    int(p.get("state_bytes", 0)), d.get("cost_note", ""), tuple(d.get("discovered_ops", ())))
    except (KeyError, TypeError, ValueError) as e:
        raise PlanFileError(f"{source} is a damaged autopar plan: {type(e).__name__}: {e}. "
                            "Re-create it with plan.to_json(path)") from e


def _options(n: dict) -> tuple[Alternative, ...]:
    """Alternatives are stored as placement strings over the node's own tensor metas."""
    ins = [spec_from_json(s).meta for s in n["inputs"]]
    outs = [spec_from_json(s).meta for s in n["outputs"]]
    return tuple(Alternative(tuple(Spec(parse_placements(p), m) for p, m in zip(a["inputs"], ins)),
                             tuple(Spec(parse_placements(p), m) for p, m in zip(a["outputs"], outs)),
                             a["compute_s"], a["reshard_in_s"], a["reshard_out_s"]) for a in n.get("options", ()))


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees half a file."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".autopar-", suffix=".json.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save(plan: Plan, path: str | os.PathLike) -> None:
    write_json_atomic(path, plan_to_dict(plan))


def load(path: str | os.PathLike) -> Plan:
    path = os.fspath(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise PlanFileError(f"plan file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanFileError(f"plan file {path} is corrupt or truncated ({e}); re-create it with "
                            "plan.to_json(path)") from None
    return plan_from_dict(data, source=f"plan file {path}")
