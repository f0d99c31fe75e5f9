"""Bad input fails with a typed error naming the culprit; unknown ops are replicated
with one warning. Offline (no ranks) except where a process group is the point."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar.passes.strategies.strategies import MissingRuleWarning
from tests.models import MLP


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # torch.export cannot trace a branch on a tensor's value
            return x * 2
        return x


class Flipper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.flip(self.lin(x), [0]).cummax(1).values


def test_untraceable_model_names_model_and_quotes_export():
    with pytest.raises(autopar.TraceError) as err:
        autopar.plan(DataDependent(), (torch.randn(4, 4),), mesh=(2,))
    msg = str(err.value)
    assert "DataDependent" in msg and "torch.export" in msg
    assert "data-dependent" in msg.lower() or "guard" in msg.lower() or "Could not" in msg


def test_op_without_rule_is_replicated_with_one_warning():
    # with discovery off (or when it finds nothing), an op without a hand rule runs whole
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(Flipper().eval(), (torch.randn(8, 8),), mesh=(2, 2), discover_rules=False)
    missing = [w for w in caught if issubclass(w.category, MissingRuleWarning)]
    assert len(missing) == 1
    assert "aten.flip.default" in str(missing[0].message) and "aten.cummax.default" in str(missing[0].message)
    assert "aten.flip.default" in plan.unruled_ops
    flip = next(n for n in plan.nodes if n.op == "aten.flip.default")
    assert flip.outputs[0].is_replicated() and all(s.is_replicated() for s in flip.inputs)


def test_op_without_hand_rule_gets_discovered_rules():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(Flipper().eval(), (torch.randn(8, 8),), mesh=(2, 2))
    assert not [w for w in caught if issubclass(w.category, MissingRuleWarning)]
    assert {"aten.flip.default", "aten.cummax.default"} <= set(plan.discovered_ops) and not plan.unruled_ops
    flip = next(n for n in plan.nodes if n.op == "aten.flip.default")
    assert len(flip.options) > 1  # more than replication to choose from
    assert "sharded by discovered rules" in plan.summary()


@pytest.mark.parametrize("mesh", [(0, 2), (2, -1), (), "2xfour", "x", "0x4", (2.0, 2)])
def test_malformed_mesh_is_refused(mesh):
    with pytest.raises(autopar.MeshError) as err:
        autopar.plan(MLP().eval(), (torch.randn(4, 16),), mesh=mesh)
    assert "mesh" in str(err.value)


@pytest.mark.parametrize("text", ["2x4", "2,4", "(2, 4)", " 2 x 4 "])
def test_a_mesh_written_as_text_is_parsed(text):
    from autopar.core.mesh import Mesh
    assert Mesh.of(text) == Mesh((2, 4))


def test_a_mesh_text_that_is_no_shape_says_how_to_write_one():
    from autopar.core.mesh import Mesh
    with pytest.raises(autopar.MeshError) as err:
        Mesh.of("2xfour")
    assert "'2x4'" in str(err.value) and "(2, 4)" in str(err.value)


def test_compile_without_process_group_says_how_to_launch():
    with pytest.raises(autopar.ProcessGroupError) as err:
        autopar.compile(MLP().eval(), mesh=(2, 4))
    assert "torchrun" in str(err.value) and "autopar.plan" in str(err.value)


def test_buffer_mutation_is_planned_not_refused():
    # BatchNorm in training updates its running statistics in place: the writes are
    # carried through as outputs that update the buffers (passes/trace/trace.py BufferUpdate)
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    plan = autopar.plan(bn, (torch.randn(8, 4),), mesh=(2,))
    assert plan.model_name == "Sequential" and plan.nodes


class FrozenScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x):
        self.scale.add_(1.0)  # eager allows it (no gradient); every rank holds its own block
        return x * self.scale


def test_parameter_mutation_is_refused_clearly():
    with pytest.raises(autopar.UnsupportedModelError) as err:
        autopar.plan(FrozenScale(), (torch.randn(8, 4),), mesh=(2,))
    msg = str(err.value)
    assert "mutates parameter scale" in msg and "model FrozenScale" in msg and "add_" in msg, msg


def test_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError) as err:
        autopar.plan(MLP().eval(), (torch.randn(4, 16),), mesh=(2,), devcie="h100")
    assert "devcie" in str(err.value)


def test_unknown_device_preset_lists_the_known_ones():
    with pytest.raises(autopar.OptionsError) as err:
        autopar.plan(MLP().eval(), (torch.randn(4, 16),), mesh=(2,), device="tpu9")
    assert "h100" in str(err.value)


class MutatesInput(nn.Module):
    def forward(self, x):
        x.add_(1.0)
        return x * 2


def test_model_that_mutates_its_input_is_refused():
    with pytest.raises(autopar.UnsupportedModelError) as err:
        autopar.plan(MutatesInput(), (torch.randn(4, 4),), mesh=(2,))
    assert "input #0" in str(err.value) and "add_" in str(err.value)


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_mesh_that_does_not_match_the_world_size(one_rank_group):
    with pytest.raises(autopar.MeshError) as err:
        autopar.compile(MLP().eval(), mesh=(2, 2))
    assert "(2, 2)" in str(err.value) and "1 ranks" in str(err.value)


def test_parameters_on_mixed_devices(one_rank_group):
    model = MLP().eval()
    model.layers[0].weight = nn.Parameter(torch.empty(64, 16, device="meta"))
    with pytest.raises(autopar.MeshError) as err:
        autopar.compile(model, mesh=(1,))
    assert "several devices" in str(err.value) and "meta" in str(err.value)


def test_inputs_on_another_device_are_refused(one_rank_group):
    pm = autopar.compile(MLP().eval(), mesh=(1,))
    with pytest.raises(autopar.InputMismatchError) as err:
        pm(torch.randn(2, 16, device="meta"))
    assert "meta" in str(err.value) and "input" in str(err.value)


def test_new_input_shapes_are_replanned_not_misread(one_rank_group):
    model = MLP().eval()
    pm = autopar.compile(model, mesh=(1,))
    for x in (torch.randn(2, 16), torch.randn(5, 16), torch.randn(2, 16)):
        with torch.no_grad():
            torch.testing.assert_close(pm(x), model(x))
    assert len(pm.programs) == 2  # one plan per shape signature, reused for a repeat


def test_heads_that_do_not_divide_the_axis_are_never_split():
    from tests.test_fuzz import check_simulated
    spec = {"hidden": 12, "blocks": [("attn", 3), ("mlp", 8)], "out": 6, "bias": True, "residual": True,
            "softmax": False, "causal": False, "batch": 1, "seq": 4, "mesh": (1, 4), "alpha_s": 1e-9, "seed": 3}
    check_simulated(spec)  # plan valid and outputs/gradients equal on every rank
    from tests import fuzz_models
    model, x = fuzz_models.build(spec)
    plan = autopar.plan(model, (x,), mesh=(1, 4), device=fuzz_models.device_for(spec))
    sdpa = next(n for n in plan.nodes if "scaled_dot_product" in n.op)
    assert autopar.Shard(1) not in sdpa.outputs[0].placements  # 3 heads cannot split 4 ways


class ValueSized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y[y > 0].sum()  # the row count depends on y's values


def test_a_size_that_depends_on_values_is_a_trace_error_naming_op_and_line():
    with pytest.raises(autopar.TraceError) as err:
        autopar.plan(ValueSized(), (torch.randn(4, 8),), mesh=(2,))
    msg = str(err.value)
    assert "aten.index.Tensor" in msg and "test_errors.py" in msg and "depends on tensor values" in msg, msg
    assert "torch.where" in msg


def _cut_plan(tmp_path, edit) -> str:
    import json
    plan = autopar.plan(MLP().eval(), (torch.randn(4, 16),), mesh=(2,))
    path = tmp_path / "plan.json"
    plan.to_json(path)
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))
    return str(path)


def test_a_plan_file_cut_short_is_refused_at_load_naming_the_file(tmp_path):
    path = _cut_plan(tmp_path, lambda d: d.update(nodes=[n for n in d["nodes"] if n["name"] != "output"]))
    with pytest.raises(autopar.PlanFileError) as err:
        autopar.Plan.from_json(path)
    assert path in str(err.value) and "'output'" in str(err.value)


def test_a_plan_file_missing_a_node_of_the_graph_is_refused_before_running(tmp_path):
    from autopar.core.plan import Plan
    from autopar.passes.lower.emit import check_fingerprint
    from autopar.passes.trace.trace import trace
    x = torch.randn(4, 16)
    path = _cut_plan(tmp_path, lambda d: d.update(
        nodes=[n for n in d["nodes"] if n["name"] != "relu_1"],
        edges=[e for e in d["edges"] if "relu_1" not in (e["producer"], e["consumer"])]))
    with pytest.raises(autopar.PlanFileError) as err:
        check_fingerprint(Plan.from_json(path), trace(MLP().eval(), (x,)), f"plan file {path}")
    assert "relu_1" in str(err.value) and path in str(err.value)


def test_a_plan_book_round_trips_and_a_graph_it_lacks_is_named(tmp_path):
    import autopar
    from autopar.core.plan_book import PlanBook
    from tests import models
    plans = []
    for batch in (2, 4):
        args, kwargs = models.inputs("gpt2", batch, 8)
        plans.append(autopar.plan(models.build("gpt2"), args, kwargs, mesh=(2,)))
    book = PlanBook.of(plans + plans[:1])
    assert len(book.plans) == 2  # one plan per graph
    path = tmp_path / "book.json"
    book.to_json(path)
    again = PlanBook.from_json(path)
    assert again.digest() == book.digest() and [p.fingerprint for p in again.plans] == [p.fingerprint for p in plans]
    plans[0].to_json(tmp_path / "one.json")  # a plan file is a book of one
    assert PlanBook.from_json(tmp_path / "one.json").plans[0].digest() == plans[0].digest()
    with pytest.raises(autopar.FingerprintMismatchError, match="has plans for 2 graphs"):
        book.plan_for("0123456789abcdef", (), "GPT2LMHeadModel", "plan file book.json")
    (tmp_path / "empty.json").write_text('{"schema": "autopar.plan_book", "schema_version": 1, "plans": []}')
    with pytest.raises(autopar.PlanFileError, match="holds no plans"):
        PlanBook.from_json(tmp_path / "empty.json")
    (tmp_path / "other.json").write_text('{"schema": "something else"}')
    with pytest.raises(autopar.PlanFileError, match="not an autopar plan or plan book"):
        PlanBook.from_json(tmp_path / "other.json")


def test_an_op_pinned_to_a_layout_its_rule_lacks_names_the_node_and_line():
    # a hand plan's attention pin the rule cannot honour (2 key/value heads over 4 ranks)
    from autopar.core.placement import Shard
    from autopar.passes.plan.planning import plan_traced, trace_for_planning
    from autopar.core.errors import PinError
    from autopar.passes.strategies.strategies import OpOutput
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from tests import models
    model = models.build("causal")
    args, kwargs = models.inputs("causal")
    traced = trace_for_planning(model, args, kwargs)
    sdpa = next(n.name for n in traced.gm.graph.nodes if "scaled_dot_product" in str(n.target))
    with pytest.raises(PinError, match=rf"node {sdpa} .* at .*models.py.* pinned to S\(1\), which its rule does not "
                                       r"offer on this mesh; it offers .*S\(2\)"):
        plan_traced(traced, Mesh.of((4,)), Options(device="cpu"), {OpOutput(sdpa): (Shard(1),)})


def test_a_sequence_a_context_parallel_style_cannot_split_is_refused_naming_input_and_size():
    # 10 tokens over both axes of (2, 4): an uneven split must be on one axis
    from autopar.core.errors import HandPlanError
    from tests import models
    model = models.build("causal")
    args, kwargs = models.inputs("causal", batch=2, seq=10)
    with pytest.raises(HandPlanError, match=r"style 'cp' splits the sequence \(dim 1\) of input kwargs\['input_ids'\] "
                                            r"\(10 positions\) 8 ways over mesh axes \(0, 1\).*dp_cp"):
        autopar.hand_plan(model, args, kwargs, mesh=(2, 4), style="cp", device="cpu")
