"""Every plan one module runs, one per traced graph: a module called with several input
signatures (generation's prefill and decode, training and evaluation), or with
Options.dynamic over several ranges, traces and plans a graph for each. A PlanBook holds
them all, so `pm.plan_book.to_json(path)` and `compile(..., plan=path)` run every one of
those calls without solving:

    {"schema": "autopar.plan_book", "schema_version": 1, "plans": [<plan>, <plan>, ...]}

each <plan> as Plan.to_dict writes it (autopar/core/plan_io.py). The runtime looks a
traced graph's plan up by its graph fingerprint (core/plan.py) and, where one graph with
symbolic sizes has several plans (Options.dynamic priced it at Dynamic.plan_at and again
at a call's own sizes), by the input sizes it was priced at. A single plan file reads as
a book of one plan, so every `plan=` takes either.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Optional

from autopar.core.errors import FingerprintMismatchError, PlanFileError
from autopar.core.files import read_json, write_json_atomic
from autopar.core.kinds import NodeKind
from autopar.core.plan import Plan
from autopar.core.plan_io import REMEDY, SCHEMA as PLAN_SCHEMA

SCHEMA = "autopar.plan_book"
SCHEMA_VERSION = 1

# ((input node, shape), ...): the sizes a plan was priced at (a symbolic dim's hint)
PricedAt = tuple[tuple[str, tuple[int, ...]], ...]


def priced_at(plan: Plan) -> PricedAt:
    return tuple(sorted((n.name, tuple(n.outputs[0].meta.shape)) for n in plan.nodes
                        if n.kind is NodeKind.USER_INPUT and n.outputs))


@dataclass(frozen=True)
class PlanBook:
    plans: tuple[Plan, ...]

    @staticmethod
    def of(plans: "list[Plan] | tuple[Plan, ...]") -> "PlanBook":
        """The plans in order, the first of each graph and priced sizes kept."""
        seen: dict[tuple, Plan] = {}
        for p in plans:
            seen.setdefault((p.fingerprint, priced_at(p)), p)
        return PlanBook(tuple(seen.values()))

    def plan_for(self, fingerprint: str, sizes: PricedAt, model_name: str, source: str) -> Plan:
        """The plan of the graph `fingerprint` priced at `sizes`, else that graph's first
        plan; FingerprintMismatchError naming `source` and the graphs it has plans for
        when it has none for this graph."""
        same_graph = [p for p in self.plans if p.fingerprint == fingerprint]
        if same_graph:
            return next((p for p in same_graph if priced_at(p) == sizes), same_graph[0])
        if len(self.plans) == 1:
            only = self.plans[0]
            said = f"was made for {only.model_name} with graph fingerprint {only.fingerprint}"
        else:
            said = f"has plans for {len(self.plans)} graphs ({', '.join(p.fingerprint for p in self.plans)})"
        raise FingerprintMismatchError(
            f"{source} {said}, but {model_name} with these inputs traces to {fingerprint}; re-plan for this model "
            "and these input shapes (or save the book of a module that ran them: pm.plan_book.to_json)",
            expected=self.plans[0].fingerprint if self.plans else "", found=fingerprint)

    def digest(self) -> str:
        """A hash of every plan's digest, in order."""
        return hashlib.sha256(repr([p.digest() for p in self.plans]).encode()).hexdigest()[:16]

    def summary(self) -> str:
        lines = [f"plan book: {len(self.plans)} plans"]
        for p in self.plans:
            lines.append(f"  {p.fingerprint}  {p.model_name} on mesh {p.mesh.shape}, "
                         f"{'training' if p.training else 'inference'}, predicted {p.total_s * 1e3:.3f} ms")
        return "\n".join(lines)

    # ---- artifacts -------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "plans": [p.to_dict() for p in self.plans]}

    @staticmethod
    def from_dict(data: Any, source: str = "<dict>") -> "PlanBook":
        """A book from its JSON-ready form, or a book of the one plan a plan's form holds;
        PlanFileError naming `source` if it is neither."""
        if isinstance(data, dict) and data.get("schema") == PLAN_SCHEMA:
            return PlanBook((Plan.from_dict(data, source),))
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise PlanFileError(f"{source} is not an autopar plan or plan book (no \"schema\": \"{PLAN_SCHEMA}\" or "
                                f"\"{SCHEMA}\" field)")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise PlanFileError(f"{source} has plan book schema version {data.get('schema_version')!r}; this autopar "
                                f"reads version {SCHEMA_VERSION}. Re-plan with this version")
        plans = data.get("plans")
        if not isinstance(plans, list) or not plans:
            raise PlanFileError(f"{source} is a damaged plan book: it holds no plans. {REMEDY}")
        return PlanBook(tuple(Plan.from_dict(d, f"{source}, plan {k}") for k, d in enumerate(plans)))

    def to_json(self, path: "str | os.PathLike") -> None:
        """Save atomically as JSON: a reader sees the old file or the new one, never half."""
        write_json_atomic(path, self.to_dict())

    @staticmethod
    def from_json(path: "str | os.PathLike") -> "PlanBook":
        """A saved book, or a saved plan as a book of one; PlanFileError naming the file."""
        path = os.fspath(path)
        return PlanBook.from_dict(read_json(path, "plan file", REMEDY), f"plan file {path}")


def given_plans(plan: "Plan | PlanBook | str | os.PathLike | None") -> tuple[Optional[PlanBook], str]:
    """What a `plan=` argument gives the runtime to run instead of solving, and how to name
    it in errors."""
    if plan is None:
        return None, ""
    if isinstance(plan, Plan):
        return PlanBook((plan,)), "the given plan"
    if isinstance(plan, PlanBook):
        return plan, "the given plan book"
    return PlanBook.from_json(plan), f"plan file {os.fspath(plan)}"
