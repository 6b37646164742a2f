"""Compiled DCP target against the unsharded eager model, on 1-4 gloo ranks."""

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.models import LlamaConfig
from dcp_compile.runtime.generate import greedy_decode
from dcp_compile.runtime.launch import spawn_ranks
from tests.support import FP32_TOLERANCE, PROMPT_LENGTHS, make_model, make_prompts, parity_worker

STEPS = 20


def assert_parity(results, size):
    for rank, r in enumerate(results):
        assert torch.equal(r["tokens"], r["reference_tokens"]), f"rank {rank} of {size}: tokens differ"
        torch.testing.assert_close(r["logits"], r["reference_logits"], **FP32_TOLERANCE)
        assert torch.equal(r["logits"], results[0]["logits"]), "every rank must hold bitwise the same logits"
    assert results[0]["tokens"].shape == (len(PROMPT_LENGTHS), STEPS + 1)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_parity_aot_eager(size):
    results = spawn_ranks(parity_worker, size, "aot_eager", "enable_gqa", STEPS, timeout=600)
    assert_parity(results, size)
    cfg = LlamaConfig()
    for r in results:
        expected_collectives = 0 if size == 1 else 2 * cfg.n_layers  # all-gather + wait per layer
        assert r["collectives"] == [expected_collectives] * 2, "one prefill and one decode graph"


def test_parity_all_to_all_by_head_group():
    # 4 query heads: a2a gives each of 2 ranks 2 heads to merge.
    size = 2
    results = spawn_ranks(parity_worker, size, "aot_eager", "enable_gqa", STEPS, 1, "a2a", timeout=600)
    assert_parity(results, size)
    cfg = LlamaConfig()
    for r in results:
        assert r["collectives"] == [4 * cfg.n_layers] * 2, "all-to-all + all-gather and their waits, per layer"


@pytest.mark.parametrize("gqa,interleave", [("repeat_interleave", 2), ("expand", 4)])
def test_parity_gqa_forms_and_interleave(gqa, interleave):
    assert_parity(spawn_ranks(parity_worker, 3, "aot_eager", gqa, STEPS, interleave, timeout=600), 3)


@pytest.mark.inductor
def test_parity_inductor_two_ranks():
    assert_parity(spawn_ranks(parity_worker, 2, "inductor", "enable_gqa", STEPS, timeout=900), 2)


@pytest.mark.inductor
def test_group_of_one_equals_plain_torch_compile_exactly():
    cfg = LlamaConfig()
    prompts = make_prompts()
    plain = torch.compile(make_model(cfg), fullgraph=True, dynamic=False)
    expected = greedy_decode(plain, prompts, 6)
    torch._dynamo.reset()
    group = dcp.init_group("cpu")
    assert group.size == 1
    model = make_model(cfg)
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
    compiled = torch.compile(model, backend=dcp.backend(group, "target"), fullgraph=True, dynamic=False)
    got = greedy_decode(compiled, prompts, 6)
    assert torch.equal(got.tokens, expected.tokens)
    for a, b in zip(got.logits, expected.logits):
        assert torch.equal(a, b), "the off arm must be bitwise plain torch.compile"


def test_single_gpu_cascade_matches_eager_without_a_collective():
    from dcp_compile.passes.shard_attention import PREFIX_ATTENTION

    cfg = LlamaConfig()
    prompts = make_prompts()
    expected = greedy_decode(make_model(cfg), prompts, STEPS)
    group = dcp.init_group("cpu")
    model = make_model(cfg)
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
    backend = dcp.backend(group, "target", cascade=True, lowering="aot_eager")
    got = greedy_decode(torch.compile(model, backend=backend, fullgraph=True, dynamic=False), prompts, STEPS)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), **FP32_TOLERANCE)
    assert backend.collective_counts == [0, 0]
    for c in backend.compiled:
        assert sum(n.target is PREFIX_ATTENTION for n in c.graph_module.graph.nodes) == cfg.n_layers
