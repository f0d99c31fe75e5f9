"""Pipeline parallelism as plan data: which mesh axis pipelines, the stages, the schedule.

    Plan.pipeline: PipelinePlan | None   (None: no axis pipelines; the JSON has no key)

A pipelined plan splits the repeated blocks of the model (passes/strategies/clusters.py) into
contiguous ranges, one per stage; stage k runs on the ranks whose coordinate on the
pipeline axis is k, a sub-mesh (the mesh without that axis) on which its own intra-op
plan runs. The first stage also holds what comes before the blocks (embeddings), the
last what comes after (final norm, head, loss). Microbatches split the batch (dim 0 of
every tensor input) so that stages overlap; the schedule orders them (torch's
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B).

Plain frozen values and their JSON form (the Plan's schema lives in plan_io.py, which
calls pipeline_to_json / pipeline_from_json for its optional "pipeline" key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.core.errors import MemoryBudgetError, OptionsError, SolverError
from autopar.core.kinds import TextEnum
from autopar.core.mesh import Mesh


class PipelineError(OptionsError):
    """A pipeline request that cannot be met (too many stages, microbatches that do not
    divide the batch, an axis that is not on the mesh)."""


class PipelineMemoryError(MemoryBudgetError):
    """No split of the blocks into pipeline stages keeps the heaviest pipeline rank within
    Options.memory_budget_bytes; carries the budget, the smallest heaviest rank any split
    reaches, and the request (so a caller catching MemoryBudgetError sees the same fields)."""

    def __init__(self, budget: int, smallest: int, stages: int, blocks: int, schedule: str) -> None:
        self.budget_bytes, self.smallest_bytes = budget, smallest
        self.stages, self.blocks, self.schedule = stages, blocks, schedule
        more_microbatches = ("use more microbatches (each holds fewer activations)" if schedule != "gpipe" else
                             "use schedule '1f1b' with more microbatches (GPipe holds every microbatch's activations)")
        SolverError.__init__(self, (
            f"no split of {blocks} blocks into {stages} pipeline stages ({schedule}) fits the memory budget of "
            f"{budget} bytes ({budget / 2**20:.2f} MiB) per rank; the smallest heaviest pipeline rank any split "
            f"reaches is {smallest} bytes ({smallest / 2**20:.2f} MiB). Pipeline over more stages (a larger "
            f"pipeline axis), {more_microbatches}, use a larger mesh, or raise Options.memory_budget_bytes"))

    def __reduce__(self):
        return (type(self), (self.budget_bytes, self.smallest_bytes, self.stages, self.blocks, self.schedule))


class PipelineAxis(TextEnum):
    """Options.pipeline_axis besides an axis number."""

    AUTO = "auto"  # the planner decides whether and on which axis pipelining pays

    def __repr__(self) -> str:  # shown as the keyword a user passes (pipeline_axis='auto')
        return repr(self.value)


class Schedule(TextEnum):
    """The order stages run microbatches in (torch.distributed.pipelining's schedules)."""

    GPIPE = "gpipe"  # all forwards, then all backwards: bubble (S-1)/M, M microbatches live
    ONE_F_ONE_B = "1f1b"  # one forward, one backward once warm: same bubble, at most S live
    INTERLEAVED_1F1B = "interleaved_1f1b"  # v chunks per rank: bubble (S-1)/(v M)

    @staticmethod
    def of(value: "Schedule | str") -> "Schedule":
        return Schedule.of_option(value, "pipeline_schedule", PipelineError)

    @property
    def chunks_per_rank(self) -> int:
        """Stages (model chunks) each pipeline rank holds."""
        return 2 if self is Schedule.INTERLEAVED_1F1B else 1


@dataclass(frozen=True)
class Stage:
    """One stage: blocks [first, stop) of the container, on pipeline coordinate `rank`."""

    index: int  # stage number in model order
    rank: int  # coordinate on the pipeline axis that runs it
    first: int  # first block index (inclusive)
    stop: int  # last block index + 1
    step_s: float  # predicted seconds of one microbatch through this stage (forward + backward)
    send_bytes: int  # activation bytes of one microbatch sent on to the next stage (0 for the last)
    send_s: float  # seconds to send them over the pipeline axis (and their gradient back, training)

    @property
    def blocks(self) -> range:
        return range(self.first, self.stop)


@dataclass(frozen=True)
class PipelinePlan:
    axis: int  # the mesh axis whose coordinate is the stage
    microbatches: int
    schedule: Schedule
    container: str  # module path of the repeated blocks, e.g. "transformer.h"
    blocks: int  # how many blocks the container has
    stages: tuple[Stage, ...]
    bubble_s: float  # predicted idle seconds per step on the slowest stage
    step_s: float  # predicted seconds of one step (all microbatches)

    @property
    def split_points(self) -> tuple[str, ...]:
        """Module paths each later stage begins at: "transformer.h.2"."""
        return tuple(f"{self.container}.{s.first}" for s in self.stages[1:])

    def summary(self) -> str:
        ranges = ", ".join(f"{s.first}-{s.stop - 1}" for s in self.stages)
        return (f"  pipeline: axis {self.axis}, {len(self.stages)} stages over {self.container} blocks [{ranges}], "
                f"{self.schedule} with {self.microbatches} microbatches; bubble {self.bubble_s * 1e3:.3f} ms "
                f"of {self.step_s * 1e3:.3f} ms")


def stage_mesh(mesh: Mesh, axis: int) -> Mesh:
    """The mesh one stage runs on: `mesh` without the pipeline axis ((1,) if nothing is left)."""
    rest = tuple(s for a, s in enumerate(mesh.shape) if a != axis)
    return Mesh(rest or (1,))


def check_request(mesh_shape: tuple[int, ...], axis: Any, microbatches: Any) -> None:
    """A clear error for a pipeline axis that is not a mesh axis (nor "auto") or
    microbatches that are not a positive int."""
    if axis is not PipelineAxis.AUTO and not (isinstance(axis, int) and not isinstance(axis, bool) and 0 <= axis < len(mesh_shape)):
        raise PipelineError(f"pipeline_axis={axis!r} is not an axis of mesh {mesh_shape}; give an axis number "
                            f"0..{len(mesh_shape) - 1}, 'auto' (the planner decides) or None")
    if not (isinstance(microbatches, int) and not isinstance(microbatches, bool) and microbatches >= 1):
        raise PipelineError(f"microbatches={microbatches!r} must be a positive int (usually a multiple of the "
                            "pipeline stages)")


def check_microbatches(schedule: Schedule, microbatches: int, ranks: int) -> None:
    """A PipelineError, before anything is solved, for microbatches torch's schedule would
    refuse when the pipeline is built: 1F1B needs at least one microbatch per stage, and
    interleaved 1F1B splits them into rounds of one per rank (a whole number of rounds)."""
    stages = ranks * schedule.chunks_per_rank
    if schedule is Schedule.ONE_F_ONE_B and microbatches < stages:
        raise PipelineError(f"microbatches={microbatches} is fewer than the {stages} stages of a 1F1B pipeline over "
                            f"{ranks} ranks; use microbatches >= {stages} or pipeline_schedule='gpipe'")
    rounds = max(1, microbatches // ranks)
    if schedule is Schedule.INTERLEAVED_1F1B and microbatches % rounds:
        raise PipelineError(f"microbatches={microbatches} is not a whole number of rounds of {ranks} (one per "
                            f"pipeline rank) as interleaved 1F1B needs; use a multiple of {ranks}")


def pipeline_to_json(p: PipelinePlan) -> dict:
    return {"axis": p.axis, "microbatches": p.microbatches, "schedule": p.schedule.value,
            "container": p.container, "blocks": p.blocks, "bubble_s": p.bubble_s, "step_s": p.step_s,
            "stages": [{"index": s.index, "rank": s.rank, "first": s.first, "stop": s.stop, "step_s": s.step_s,
                        "send_bytes": s.send_bytes, "send_s": s.send_s} for s in p.stages]}


def pipeline_from_json(d: dict) -> PipelinePlan:
    stages = tuple(Stage(int(s["index"]), int(s["rank"]), int(s["first"]), int(s["stop"]), float(s["step_s"]),
                         int(s["send_bytes"]), float(s["send_s"])) for s in d["stages"])
    return PipelinePlan(int(d["axis"]), int(d["microbatches"]), Schedule(d["schedule"]), d["container"],
                        int(d["blocks"]), stages, float(d["bubble_s"]), float(d["step_s"]))
