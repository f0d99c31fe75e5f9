"""Options.device="auto" (the default): the accelerator's preset and memory, the CPU preset
without one; presets know device memory, and a plan predicted over it warns."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.cost_models import devices
from autopar.passes.plan.planning import DeviceMemoryWarning
from tests.models import MLP


def _plan(**options):
    return autopar.plan(MLP().eval(), (torch.randn(4, 16),), mesh=(2,), **options)


def test_auto_is_the_default_and_is_the_cpu_preset_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert autopar.Options().device == "auto"
    plan = _plan()
    assert plan.device == "cpu" and plan.cost_note == "analytic preset cpu"


def _fake_gpu(monkeypatch, name: str, memory: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: type("P", (), {"total_memory": memory}))


@pytest.mark.parametrize("name, preset", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                          ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA B200", "b200")])
def test_auto_reads_a_gpus_name_and_memory(monkeypatch, name, preset):
    _fake_gpu(monkeypatch, name, 79 * 2**30)
    spec = devices.detected_device()
    assert (spec.name, spec.memory_bytes, spec.detected) == (preset, 79 * 2**30, name)
    assert f"analytic preset {preset} (auto-detected {name}, 79.0 GiB per device)" in _plan().summary()


def test_an_unknown_gpu_is_priced_as_an_a100_with_a_warning(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA GeForce RTX 9090", 24 * 2**30)
    with pytest.warns(UserWarning, match="no cost preset for NVIDIA GeForce RTX 9090; it is priced as an A100"):
        spec = devices.detected_device()
    assert spec.name == "a100" and spec.memory_bytes == 24 * 2**30


def test_presets_know_their_memory_and_a_plan_over_it_warns():
    assert devices.preset("h100").memory_bytes == 80 * 2**30 and devices.preset("cpu").memory_bytes is None
    small = replace(devices.preset("cpu"), name="tiny-device", memory_bytes=1024)
    with pytest.warns(DeviceMemoryWarning, match=r"more than the 0.0 GiB of one tiny-device"):
        _plan(device=small)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeviceMemoryWarning)
        _plan(device="h100")  # a tiny MLP fits an H100


def test_a_registered_preset_is_found_by_name():
    mine = replace(devices.preset("h100"), name="my-accelerator")
    devices.register_preset(mine)
    try:
        assert _plan(device="my-accelerator").device == "my-accelerator"
    finally:
        del devices.PRESETS["my-accelerator"]


def test_the_detected_gpus_memory_is_the_default_budget(monkeypatch):
    # 90 % of what torch reports for the card, stated in the summary and in the refusal;
    # a named preset (an offline plan for another machine) and the CPU stay unbounded
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 79 * 2**30)
    assert autopar.Options().memory_budget_bytes == "auto"
    assert devices.memory_budget("auto", devices.detected_device()) == int(79 * 2**30 * 0.9)
    assert "memory budget 71.1 GiB: 90% of the detected NVIDIA H100 80GB HBM3's 79.0 GiB" in _plan().summary()
    assert devices.memory_budget("auto", devices.preset("h100")) is None
    assert "memory budget" not in _plan(device="h100").summary()
    assert devices.memory_budget(None, devices.detected_device()) is None
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 4 * 1024)  # a card of 4 KiB: nothing fits
    with pytest.raises(autopar.MemoryBudgetError, match=r"per rank \(the default memory budget 0.0 GiB: "
                                                        r"90% of the detected NVIDIA H100 80GB HBM3's"):
        _plan()


def test_a_budget_that_is_no_number_is_refused():
    with pytest.raises(autopar.OptionsError, match=r"memory_budget_bytes='lots'.*None for no bound, or 'auto'"):
        autopar.Options(memory_budget_bytes="lots")


@pytest.mark.slow  # three solves of GPT-2
def test_the_default_budget_binds_only_where_the_free_plan_would_not_fit(monkeypatch):
    # on a card the fastest plan fits, "auto" gives that plan, solved without a bound (the
    # same ILP as None); on a card it does not fit, the plan is bounded to 90 % of it
    from tests import models
    model = models.build("gpt2").train()
    args, kwargs = models.inputs("gpt2", batch=4)

    def plan(**options):
        return autopar.plan(model, args, kwargs, mesh=(2,), **options)

    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 79 * 2**30)
    free, auto = plan(memory_budget_bytes=None), plan()
    assert auto.digest() == free.digest() and auto.solver.variables == free.solver.variables
    card = int(free.memory_bytes * 0.8 / 0.9)
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", card)
    bounded = plan()
    assert bounded.memory_bytes <= int(card * 0.9) < free.memory_bytes
