"""A saved plan's collectives as a reader wants them: grouped by the module they serve,
with their kinds, counts and MiB per rank (what `python -m autopar show` prints)."""

from __future__ import annotations

from autopar.core.plan import Plan


def collectives_by_module(plan: Plan) -> list[str]:
    """One line per module path (forward order of first use): each kind@axis with its count
    and MiB this rank sends; a collective belongs to the module of the op that reads it."""
    modules = {n.name: n.module for n in plan.nodes}
    groups: dict[str, dict[str, list[float]]] = {}
    for c in plan.collectives():
        module = modules.get(c.consumer) or modules.get(c.producer) or "(model inputs and outputs)"
        kinds = groups.setdefault(module, {})
        count_mib = kinds.setdefault(f"{c.kind}@axis{c.axis}", [0, 0.0])
        count_mib[0] += 1
        count_mib[1] += c.nbytes / 2**20
    if not groups:
        return ["  none: every op runs on its own blocks"]
    width = min(max(len(m) for m in groups), 60)
    return [f"  {module:<{width}}  " + ", ".join(f"{kind} x{n} {mib:.2f} MiB" for kind, (n, mib) in kinds.items())
            for module, kinds in groups.items()]
