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


def test_a_rewritten_graph_is_one_aot_autograd_may_cache_across_processes(monkeypatch):
    """The passes call this package's helpers from the graphs they build; lowered, those are
    marked cacheable under a key of the package's source, in a stable order (the key of
    a restart must equal the first run's), and only while the graph lowers."""
    from dcp_compile.runtime.engine import generate_all
    from tests.support import agreeing_pair

    autograd_cache = pytest.importorskip("torch._functorch._aot_autograd.autograd_cache")
    target, draft = agreeing_pair("eagle3", noise=3.0, max_batch=1)
    decoder = dcp.SpecDecoder(target, draft, dcp.init_group("cpu"), k=2, max_batch=1, max_seq_len=96,
                              lowering="aot_eager")
    generate_all(decoder, [[1, 2, 3]], 2)
    graphs = [g.graph_module for b in (decoder.target_backend, decoder.draft_backend) for g in b.compiled]
    rewritten = [gm for gm in graphs if any(getattr(n.target, "__module__", "").startswith("dcp_compile.")
                                            for n in gm.graph.nodes)]
    assert rewritten, "the draft's attention runs the cascade's helpers"
    seen = []

    def fake_compile_fx(gm, example_inputs):
        seen.append(dict(inductor_config.unsafe_marked_cacheable_functions))
        autograd_cache.check_cacheable(gm)  # raises BypassAOTAutogradCache on a function it does not know
        return gm

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", fake_compile_fx)
    with pytest.raises(autograd_cache.BypassAOTAutogradCache):
        autograd_cache.check_cacheable(rewritten[0])
    for gm in rewritten:
        dcp.backend(dcp.init_group("cpu"), "draft", lowering="inductor")._lower(gm, [])
    assert all(list(marked) == sorted(marked) and len(set(marked.values())) == 1 for marked in seen)
    assert inductor_config.unsafe_marked_cacheable_functions == {}
