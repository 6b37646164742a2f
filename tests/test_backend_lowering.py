"""How the backend hands graphs to Inductor."""

import pytest
import torch
import torch._inductor.compile_fx
import torch._inductor.config as inductor_config

import dcp_compile as dcp


@pytest.mark.parametrize("size,deterministic", [(1, False), (2, True), (4, True)])
def test_groups_of_more_than_one_rank_compile_without_timing_kernels(monkeypatch, size, deterministic):
    """Ranks must pick the same kernels, so Inductor may not choose configs by timing."""
    seen = []

    def fake_compile_fx(gm, example_inputs):
        seen.append(inductor_config.deterministic)
        return gm

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", fake_compile_fx)
    group = dcp.DCPGroup(size, 0, torch.device("cpu"), None)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    with inductor_config.patch(deterministic=False):
        dcp.backend(group, "draft", lowering="inductor")._lower(gm, [torch.randn(2, 4)])
        assert inductor_config.deterministic is False, "the setting is scoped to the compile"
    assert seen == [deterministic]
