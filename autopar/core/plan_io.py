"""Plans as JSON files: a documented, versioned schema, atomic writes, validating loads.

Schema version 1 (keys of the top-level object):

    schema            "autopar.plan"
    schema_version    1
    autopar_version   version that wrote the file
    torch_version     torch that traced the model
    model             model class name
    fingerprint       hash of the traced graph (ops, wiring, shapes, dtypes, arguments and
                      keyword arguments, devices aside); a plan is only
                      applied to a model whose trace has the same fingerprint
    mesh              [axis sizes]
    training          whether backward work was planned for
    device            cost-model preset or profile name
    predicted         {compute_s, comm_s, hidden_s, grad_sync_every, param_bytes, activation_bytes, state_bytes,
                      memory_bytes}: per rank
    solver            {solver, status, objective_s, gap, solve_time_s, variables, constraints, groups,
                       shared_blocks (absent in older files: 0), bound_s, start (the plan the
                       solver started from; absent in older files: "")}
    unruled_ops       ops replicated for want of a rule
    discovered_ops    ops sharded by rules found by experiment (absent in older files)
    routing_notes     why a sort by expert was not made a routed_experts op (absent in older files)
    cost_note         where the costs came from (preset, or profile and its missing timings)
    pipeline          only in pipelined plans: {axis, microbatches, schedule, container, blocks,
                      bubble_s, step_s, stages: [{index, rank, first, stop, step_s, send_bytes, send_s}]}
    stage_plans       only in pipelined plans: [plan]: each stage's own plan (this schema, nested),
                      in stage order (absent: the stages are planned where they run)
    recompute         [{name, nodes: [node]}]: blocks recomputed in backward (absent: none)
    links             [{kind: "intra" | "inter", name, alpha_s, beta_s_per_byte}]: per mesh axis, the link
                      its collectives were priced with (absent in older files: none recorded)
    mesh_candidates   [{shape, step_s, memory_bytes, refusal, bound_s}]: mesh="auto"'s tries (absent or
                      empty: the mesh was given; bound_s null or absent: the candidate's plan was proven its best)
    nodes             [{name, op, kind, module, group, inputs: [spec], outputs: [spec], compute_s,
                        alternatives, options: [{inputs: ["S(0)R", ..], outputs: [..], compute_s,
                        reshard_in_s, reshard_out_s}], saved: [bool] per output kept for backward
                        (training; absent: all counted)}]  (option placements over the node's metas)
    edges             [{producer, index, consumer, position, comm_s, steps: [step]}]
    collectives       [{kind, axis, nbytes, producer, consumer, backward}]: forward order, for readers
    spec              {placements: ["S(0)", "R"], shape: [..], dtype: "float32"}
    step              {kind, axis, dim, to_dim, reduce, backward, before: spec}

A node's kind (parameter, buffer, constant, user_input, getitem, output, op) is absent
in files written before it was stored; it is then read from the old op text
("placeholder:parameter").

This module is the schema only: it turns a plan's fields into JSON-ready values and
back into the fields of a Plan. The Plan class (autopar/core/plan.py) calls it, never the
other way round; the files themselves go through autopar/core/files.py.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import torch

from autopar._version import __version__
from autopar.core.errors import PlanFileError
from autopar.core.files import read_json, write_json_atomic
from autopar.core.kinds import NodeKind, StepKind
from autopar.core.links import AxisLink, Link, LinkKind
from autopar.core.mesh import Mesh
from autopar.core.pipeline import pipeline_from_json, pipeline_to_json
from autopar.core.placement import Spec, TensorMeta, parse_placement, parse_placements
from autopar.core.plan_parts import Alternative, EdgePlan, MeshCandidate, NodeChoice, RecomputedBlock, SolverReport
from autopar.core.resharding import Step

SCHEMA = "autopar.plan"
SCHEMA_VERSION = 1
REMEDY = "re-create it with plan.to_json(path)"


def spec_to_json(spec: Spec) -> dict:
    return {"placements": [str(p) for p in spec.placements], "shape": list(spec.meta.shape),
            "dtype": str(spec.meta.dtype).removeprefix("torch.")}


def spec_from_json(d: dict) -> Spec:
    dtype = getattr(torch, d["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {d['dtype']!r}")
    return Spec(tuple(parse_placement(p) for p in d["placements"]), TensorMeta(tuple(d["shape"]), dtype))


def _step_to_json(s: Step) -> dict:
    return {"kind": s.kind.value, "axis": s.axis, "dim": s.dim, "to_dim": s.to_dim, "reduce": s.reduce,
            "backward": s.backward.value, "before": spec_to_json(s.before) if s.before is not None else None}


def _step_from_json(d: dict) -> Step:
    return Step(StepKind(d["kind"]), d["axis"], d["dim"], d["to_dim"], d["reduce"], StepKind(d["backward"]),
                spec_from_json(d["before"]) if d["before"] is not None else None)


def _node_to_json(n: NodeChoice) -> dict:
    return {"name": n.name, "op": n.op, "kind": n.kind.value, "module": n.module, "group": n.group,
            "inputs": [spec_to_json(s) for s in n.inputs], "outputs": [spec_to_json(s) for s in n.outputs],
            "compute_s": n.compute_s, "alternatives": n.alternatives,
            "options": [{"inputs": [str(s) for s in a.inputs], "outputs": [str(s) for s in a.outputs],
                         "compute_s": a.compute_s, "reshard_in_s": a.reshard_in_s, "reshard_out_s": a.reshard_out_s}
                        for a in n.options], **({"saved": list(n.saved)} if n.saved else {}),
            **({"causal": True} if n.causal else {})}


def _node_kind(n: dict) -> NodeKind:
    if "kind" in n:
        return NodeKind(n["kind"])
    op = n["op"]  # files from before the kind was stored: "placeholder:<kind>", "getitem", "output", an op
    if op.startswith("placeholder:"):
        return NodeKind(op.split(":", 1)[1])
    return {"getitem": NodeKind.GETITEM, "output": NodeKind.OUTPUT}.get(op, NodeKind.OP)


def _node_from_json(n: dict) -> NodeChoice:
    kind = _node_kind(n)
    op = "placeholder" if kind.is_input else n["op"]
    return NodeChoice(n["name"], op, tuple(map(spec_from_json, n["inputs"])), tuple(map(spec_from_json, n["outputs"])),
                      float(n["compute_s"]), int(n["alternatives"]), n.get("module", ""), _options(n),
                      n.get("group", ""), kind, tuple(bool(k) for k in n.get("saved", ())),
                      bool(n.get("causal", False)))


def plan_to_dict(plan: Any) -> dict:
    """The JSON-ready form of a Plan (any object with a Plan's fields)."""
    out = _plan_dict(plan)
    if getattr(plan, "pipeline", None) is not None:
        out["pipeline"] = pipeline_to_json(plan.pipeline)
    if getattr(plan, "stage_plans", ()):
        out["stage_plans"] = [plan_to_dict(stage) for stage in plan.stage_plans]
    return out


def _plan_dict(plan: Any) -> dict:
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "autopar_version": __version__,
        "torch_version": torch.__version__, "model": plan.model_name, "fingerprint": plan.fingerprint,
        "mesh": list(plan.mesh.shape), "training": plan.training, "device": plan.device,
        "predicted": {"compute_s": plan.compute_s, "comm_s": plan.comm_s,
                      "hidden_s": getattr(plan, "hidden_s", 0.0), "param_bytes": plan.param_bytes,
                      "grad_sync_every": getattr(plan, "grad_sync_every", 1),
                      "activation_bytes": plan.activation_bytes, "state_bytes": plan.state_bytes,
                      "memory_bytes": plan.memory_bytes},
        "solver": asdict(plan.solver),
        "unruled_ops": list(plan.unruled_ops), "discovered_ops": list(plan.discovered_ops),
        "routing_notes": list(getattr(plan, "routing_notes", ())),
        "cost_note": plan.cost_note,
        "recompute": [{"name": b.name, "nodes": list(b.nodes)} for b in getattr(plan, "recompute", ())],
        "links": [dict(asdict(a.link), kind=a.kind.value) for a in getattr(plan, "links", ())],
        "mesh_candidates": [dict(asdict(c), shape=list(c.shape)) for c in plan.mesh_candidates],
        "nodes": [_node_to_json(n) for n in plan.nodes],
        "edges": [{"producer": e.producer, "index": e.index, "consumer": e.consumer, "position": e.position,
                   "comm_s": e.comm_s, "steps": [_step_to_json(s) for s in e.steps]} for e in plan.edges],
        "collectives": [dict(asdict(c), kind=c.kind.value, backward=c.backward.value) for c in plan.collectives()],
    }


def plan_fields(d: Any, source: str = "<dict>") -> dict:
    """The keyword arguments of Plan(...) stored in `d`, each stage plan still a dict (the
    Plan class reads them with this function in turn); PlanFileError naming `source` if
    it is not a plan of this schema version or is damaged."""
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise PlanFileError(f"{source} is not an autopar plan (no \"schema\": \"{SCHEMA}\" field)")
    version = d.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanFileError(f"{source} has plan schema version {version!r}; this autopar reads version "
                            f"{SCHEMA_VERSION}. Re-plan with this version (python -m autopar plan ...)")
    try:
        p = d["predicted"]
        fields = dict(
            mesh=Mesh(tuple(d["mesh"])), model_name=d["model"], fingerprint=d["fingerprint"],
            training=bool(d["training"]), device=d["device"], nodes=tuple(map(_node_from_json, d["nodes"])),
            edges=tuple(EdgePlan(e["producer"], e["index"], e["consumer"], e["position"],
                                 tuple(map(_step_from_json, e["steps"])), float(e["comm_s"])) for e in d["edges"]),
            compute_s=float(p["compute_s"]), comm_s=float(p["comm_s"]), hidden_s=float(p.get("hidden_s", 0.0)),
            param_bytes=int(p["param_bytes"]), grad_sync_every=int(p.get("grad_sync_every", 1)),
            activation_bytes=int(p["activation_bytes"]), solver=SolverReport(**d["solver"]),
            recompute=tuple(RecomputedBlock(b["name"], tuple(b["nodes"])) for b in d.get("recompute", ())),
            unruled_ops=tuple(d.get("unruled_ops", ())), state_bytes=int(p.get("state_bytes", 0)),
            cost_note=d.get("cost_note", ""), discovered_ops=tuple(d.get("discovered_ops", ())),
            routing_notes=tuple(d.get("routing_notes", ())),
            links=tuple(AxisLink(LinkKind(a["kind"]), Link(float(a["alpha_s"]), float(a["beta_s_per_byte"]), a["name"]))
                        for a in d.get("links", ())),
            pipeline=pipeline_from_json(d["pipeline"]) if "pipeline" in d else None,
            stage_plans=tuple(d.get("stage_plans", ())),
            mesh_candidates=tuple(MeshCandidate(tuple(int(n) for n in c["shape"]), _maybe(float, c["step_s"]),
                                                _maybe(int, c["memory_bytes"]), str(c.get("refusal", "")),
                                                _maybe(float, c.get("bound_s")))
                                  for c in d.get("mesh_candidates", ())))
    except (KeyError, TypeError, ValueError) as e:
        raise PlanFileError(f"{source} is a damaged autopar plan: {type(e).__name__}: {e}. {REMEDY}") from e
    return _consistent(fields, source)


def _maybe(kind: Any, value: Any) -> Any:
    return None if value is None else kind(value)


def _consistent(fields: dict, source: str) -> dict:
    """`fields`, after checking that their parts agree: one link per mesh axis (or none:
    a file written before links were recorded), an output node and edges between plan
    nodes (a plan without a pipeline), and recomputed blocks made of plan nodes;
    else evaluate and emit would fail far from the file (an IndexError on a missing axis)."""
    ndim, links = fields["mesh"].ndim, fields["links"]
    if links and len(links) != ndim:
        raise PlanFileError(f"{source} records {len(links)} links for the {ndim} axes of mesh "
                            f"{fields['mesh'].shape}; 'links' needs one per axis (or none). {REMEDY}")
    stages, pipeline = fields["stage_plans"], fields["pipeline"]
    if stages and (pipeline is None or len(stages) != len(pipeline.stages)):
        raise PlanFileError(f"{source} holds {len(stages)} stage plans for "
                            f"{len(pipeline.stages) if pipeline else 'no'} pipeline stages. {REMEDY}")
    names = {n.name for n in fields["nodes"]}
    if fields["pipeline"] is None and "output" not in names:
        raise PlanFileError(f"{source} has no node 'output' among its {len(names)} nodes: its node list was cut "
                            f"short. {REMEDY}")
    for e in fields["edges"]:
        lost = [x for x in (e.producer, e.consumer) if x not in names]
        if lost:
            raise PlanFileError(f"{source} has an edge {e.producer} -> {e.consumer} from or to node {lost[0]}, "
                                f"which is not among its nodes. {REMEDY}")
    for block in fields["recompute"]:
        missing = [n for n in block.nodes if n not in names]
        if missing:
            raise PlanFileError(f"{source} recomputes block {block.name} with nodes {missing[:3]} the plan does not "
                                f"have. {REMEDY}")
    return fields


def _options(n: dict) -> tuple[Alternative, ...]:
    """Alternatives are stored as placement strings over the node's own tensor metas."""
    ins = [spec_from_json(s).meta for s in n["inputs"]]
    outs = [spec_from_json(s).meta for s in n["outputs"]]
    return tuple(Alternative(tuple(Spec(parse_placements(p), m) for p, m in zip(a["inputs"], ins)),
                             tuple(Spec(parse_placements(p), m) for p, m in zip(a["outputs"], outs)),
                             a["compute_s"], a["reshard_in_s"], a["reshard_out_s"]) for a in n.get("options", ()))


def save(plan: Any, path: "str | os.PathLike") -> None:
    write_json_atomic(path, plan_to_dict(plan))


def load_fields(path: "str | os.PathLike") -> dict:
    """Plan(...) keyword arguments read from a plan file."""
    path = os.fspath(path)
    return plan_fields(read_json(path, "plan file", REMEDY), f"plan file {path}")
