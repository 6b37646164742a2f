"""DCP inside tensor parallelism, on spawned gloo ranks in fp32: speculative decoding with
the target sharded T ways by ``dcp.tensor_parallel`` and its KV copies sharded D ways by
token gives the tokens and accept counts of one rank running the unsharded model.

All cases share one world of 4 ranks (a case of TP size 2 runs as two replicas, each with
its own DCP size)."""

import dataclasses
import functools

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.group import DCPGroup
from dcp_compile.models.parallel import check_layout, kv_heads_of
from dcp_compile.runtime.launch import spawn_ranks
from tests.runtime.tp_workers import K, Case, reference, tp_cases_worker
from tests.support import agreeing_pair

WORLD = 4
# The greedy chain at TP 4 x DCP 2 is examples/tensor_parallel.py's, on the shipped pair.
CASES = (
    Case(4, 2, topk=2, draft_tokens=6, temperature=0.8, comm="a2a"),  # two KV heads, each on two ranks; a sampled
                                                                      # EAGLE-2 tree, partials by all-to-all
    Case(4, 4, kind="mla"),                            # MLA: one latent head on every rank
    Case(2, (2, 1), kind="mqa"),                       # one KV head: TP=2 x DCP=2 on ranks 0-1, plain TP on 2-3
)
LAYERS = 4


def dcp_of(case: Case, rank: int) -> Case:
    """The case as global ``rank`` ran it: its replica's DCP size."""
    sizes = case.dcp if isinstance(case.dcp, tuple) else (case.dcp,) * (WORLD // case.tp)
    return dataclasses.replace(case, dcp=sizes[rank // case.tp])


@functools.cache
def world_run():
    return spawn_ranks(tp_cases_worker, WORLD, list(CASES), timeout=1500)


@functools.cache
def off_arm(case: Case) -> dict:
    return reference(Case(1, 1, case.kind, case.temperature, case.topk, case.draft_tokens))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_tokens_and_accept_counts_are_the_unsharded_models(index):
    off = off_arm(CASES[index])
    ranks = [r["cases"][index] for r in world_run()]
    for rank, result in enumerate(ranks):
        assert result["tokens"] == off["tokens"], f"rank {rank}: tokens differ from the unsharded model's"
        assert result["accepted"] == off["accepted"], f"rank {rank}: accept counts differ"
        assert result["draft_unchanged"] and not any(result["draft_collectives"]), "the draft stays whole"
    assert len({a for row in off["accepted"] for a in row}) >= 2, "the batch should see several accept counts"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_each_rank_caches_its_kv_heads_and_1_over_d_of_the_slots(index):
    for rank, result in enumerate(r["cases"][index] for r in world_run()):
        case = dcp_of(CASES[index], rank)
        staging = (case.draft_tokens or K) + 1
        slots = 96 // case.dcp + 1 + staging if case.dcp > 1 or case.topk > 1 else 96
        if case.kind == "mla":
            assert result["target_cache"] == (4, slots, 32), "the latent is whole on every TP rank, 1/D of the slots"
        else:
            heads = len(kv_heads_of(result["tp_rank"], case.tp, 1 if case.kind == "mqa" else 2))
            assert result["target_cache"] == (4, heads, slots, 16)
        tree_slots = (K - 1) * case.topk if case.topk > 1 else 0
        assert result["draft_cache"][2] == 96 + tree_slots, "the draft's cache is whole"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_collectives_per_attention_site(index):
    """Per layer of a verify graph: the TP all-reduces of attention and MLP with their
    waits; under DCP the queries' all-gather, then the partials' all-gather (ag) or
    all-to-all (a2a), each with its wait."""
    for rank, result in enumerate(r["cases"][index] for r in world_run()):
        case = dcp_of(CASES[index], rank)
        expected = {"all_reduce": 2 * LAYERS, "wait_tensor": 2 * LAYERS}
        if case.dcp > 1:
            expected["all_gather_into_tensor"] = LAYERS * (2 if case.comm == "ag" else 1)
            expected["wait_tensor"] += 2 * LAYERS
            if case.comm == "a2a":
                expected["all_to_all_single"] = LAYERS
        assert result["verify_collectives"] == [expected]


def test_a_dcp_group_over_different_kv_heads_is_refused_at_prepare_on_every_rank():
    refusals = [r["refusal"] for r in world_run()]
    assert all(r is not None and "compute their KV caches from different weights" in r for r in refusals), refusals
    assert "attention.wk.weight" in refusals[0] and "D | T/H_kv" in refusals[0]
    assert len(set(refusals)) == 1, "every rank says the same"


def test_kv_heads_are_split_or_replicated():
    assert [list(kv_heads_of(r, 2, 8)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(kv_heads_of(r, 8, 2)) for r in range(8)] == [[0]] * 4 + [[1]] * 4


@pytest.mark.parametrize("shape, message", [
    (dict(n_heads=6, n_kv_heads=2, intermediate_size=96, tp=4, dcp=2), "TP size 4 does not divide the 6 query heads"),
    (dict(n_heads=8, n_kv_heads=2, intermediate_size=96, tp=4, dcp=4),
     r"DCP size 4 does not divide the 2 copies of each KV head .* \(D \| T/H_kv\)"),
    (dict(n_heads=8, n_kv_heads=4, intermediate_size=96, tp=2, dcp=2), "a DCP group would span different KV heads"),
    (dict(n_heads=8, n_kv_heads=None, intermediate_size=96, tp=4, dcp=3), "DCP size 3 does not divide TP size 4"),
    (dict(n_heads=8, n_kv_heads=2, intermediate_size=90, tp=4, dcp=2), "does not divide the MLP width 90"),
])
def test_layouts_that_cannot_be_laid_out_are_refused_with_the_rule(shape, message):
    with pytest.raises(ValueError, match=message):
        check_layout(**shape)


def test_init_group_refuses_a_dcp_size_that_does_not_divide_tp_and_a_world_of_another_size():
    with pytest.raises(ValueError, match=r"DCP size 3 does not divide TP size 4: .* --tp 4 --dcp 2"):
        dcp.init_group("cpu", tp=4, dcp=3)
    with pytest.raises(ValueError, match=r"needs a world of 2 ranks .* the world has 1; launch with `torchrun --nproc-per-node 2"):
        dcp.init_group("cpu", tp=2, dcp=2)
    with pytest.raises(ValueError, match="without tp"):
        dcp.init_group("cpu", dcp=2)


def test_a_draft_or_a_foreign_model_is_not_sharded():
    target, draft = agreeing_pair("eagle3", noise=3.0)
    group = DCPGroup(1, 0, torch.device("cpu"), None)
    with pytest.raises(ValueError, match="drafts stay whole"):
        dcp.tensor_parallel(draft, group)
    with pytest.raises(TypeError, match="parallelize_module"):
        dcp.tensor_parallel(torch.nn.Linear(2, 2), group)
    dcp.prepare(target, group, "target", max_batch=4, max_seq_len=96)
    with pytest.raises(ValueError, match="first, then dcp.prepare"):
        dcp.tensor_parallel(target, group)


def test_the_planner_prices_a_rank_of_tp():
    from dcp_compile.models.llama import llama3_8b_shape
    from dcp_compile.models.mla import deepseek_v2_lite_shape

    llama, lite = llama3_8b_shape(), deepseek_v2_lite_shape()
    one, tp8 = (dcp.MemoryPlanner(llama, 80 << 30, tp_size=t).plan(1, 8, 8192) for t in (1, 8))
    assert tp8.target_kv_bytes * 8 == one.target_kv_bytes, "8 KV heads over 8 ranks: one head a rank"
    embedding_and_head = 2 * llama.vocab_size * llama.dim * 2
    assert tp8.weight_bytes == pytest.approx(embedding_and_head + (one.weight_bytes - embedding_and_head) / 8, rel=1e-3)
    lite_one, lite_tp4 = (dcp.MemoryPlanner(lite, 80 << 30, tp_size=t).plan(d, 8, 8192) for t, d in ((1, 1), (4, 4)))
    assert lite_tp4.target_kv_bytes < lite_one.target_kv_bytes / 3.9, "the latent whole per TP rank, 1/4 of the slots"
    with pytest.raises(ValueError, match="DCP size 3 does not divide TP size 4"):
        dcp.MemoryPlanner(lite, 80 << 30, tp_size=4).plan(3, 8, 8192)
