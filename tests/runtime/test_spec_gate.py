"""The correctness gate: speculative decoding on a DCP group gives the off arm's tokens
and accept counts exactly."""

import functools

import pytest

from dcp_compile.runtime.launch import spawn_ranks
from tests.runtime.workers import diverging_spec_worker, spec_worker

K = 4


def run(size, kind, temperature=0.0, max_new_tokens=40, step_graph=False, paging=None):
    results = spawn_ranks(spec_worker, size, kind, K, temperature, max_new_tokens, step_graph, paging, timeout=900)
    for r in results[1:]:
        assert r["tokens"] == results[0]["tokens"] and r["accepted"] == results[0]["accepted"], "ranks disagree"
    return results[0]


@functools.cache
def off_run(kind, temperature=0.0, max_new_tokens=40):
    """The off arm (a group of one), shared by the group sizes it is compared with."""
    return run(1, kind, temperature=temperature, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("size", [2, 4])
def test_eagle3_gate(size):
    off = off_run("eagle3")
    dcp_arm = run(size, "eagle3")
    assert dcp_arm["tokens"] == off["tokens"]
    assert dcp_arm["accepted"] == off["accepted"]
    seen = {a for row in dcp_arm["accepted"] for a in row}
    assert seen == set(range(K + 1)), f"the batch must exercise every accept count 0..{K}, saw {sorted(seen)}"
    assert dcp_arm["finished"] == ["length"] * 4 and all(len(t) == 40 for t in dcp_arm["tokens"])
    assert dcp_arm["streamed"] == dcp_arm["tokens"]
    assert dcp_arm["collectives"]["draft"] == [0, 0, 0], "draft prefill, step and extend graphs: no collective"
    assert dcp_arm["verify_all_gathers"] == [4], "verify: one all-gather per target attention layer"
    assert dcp_arm["draft_cache"] == (4, 2, 96, 16), "the draft cache stays whole"
    assert dcp_arm["commit_compiled"], "a sharded target's verify stages its K/V: the commit moves it"
    assert not off["commit_compiled"], "a group of size 1 verifies in place: no commit graph"


def test_eagle_gate():
    """The DCP arm's target caches are paged, in a pool too small for every request at
    once (96 tokens: pages of 4 slots a rank, 8 token positions): requests wait for pages."""
    off = off_run("eagle")
    dcp_arm = run(2, "eagle", paging=dict(page_size=4, kv_tokens=96))
    assert dcp_arm["tokens"] == off["tokens"]
    assert dcp_arm["accepted"] == off["accepted"]
    seen = {a for row in dcp_arm["accepted"] for a in row}
    assert seen == set(range(K + 1)), f"the batch must exercise every accept count 0..{K}, saw {sorted(seen)}"
    assert dcp_arm["paged_graphs"] == [4, 4], "prefill and verify: each of the 4 layers' prefix reads pages"


@pytest.mark.parametrize("size", [2, 3])
def test_sampling_gate(size):
    """Sampling draws on each rank's own device generator, seeded alike: no communication,
    and still the off arm's tokens.  The DCP arm runs each step as one graph, the off arm
    the step's calls one by one."""
    off = off_run("eagle3", 0.8, 24)
    # Paged at N = 3, in a pool that holds the four requests at once (half the rows' 4 x 96
    # tokens): rows that waited for pages would draw other noise, as the off arm's would.
    paging = dict(page_size=2, kv_tokens=192) if size == 3 else None
    dcp_arm = run(size, "eagle3", temperature=0.8, max_new_tokens=24, step_graph=True, paging=paging)
    assert dcp_arm["tokens"] == off["tokens"] and dcp_arm["accepted"] == off["accepted"]
    assert any(dcp_arm["paged_graphs"]) == (paging is not None)


def test_ranks_that_diverge_all_stop_with_the_same_error():
    results = spawn_ranks(diverging_spec_worker, 2, timeout=600)
    for r in results:
        assert r["nan_agrees"] == [] and r["rank_differs"] == [1]
        assert r["error"] is not None and "DCP ranks diverged" in r["error"] and "ranks [1]" in r["error"]
    assert results[0]["error"] == results[1]["error"]


@pytest.mark.parametrize("size, temperature", [(2, 0.0), (4, 0.0), (2, 0.8)])
def test_mla_target_gate(size, temperature):
    """An MLA target (latent caches sharded) with an EAGLE3 draft (a Llama layer, whole):
    the off arm's tokens and accept counts, greedy and sampled.  At N = 4 the latent caches
    are paged, in a pool of 96 tokens that runs two of the four requests at a time."""
    off = off_run("mla", temperature, 32)
    paging = dict(page_size=2, kv_tokens=96) if size == 4 else None
    dcp_arm = run(size, "mla", temperature=temperature, max_new_tokens=32, paging=paging)
    assert dcp_arm["tokens"] == off["tokens"] and dcp_arm["accepted"] == off["accepted"]
    seen = {a for row in dcp_arm["accepted"] for a in row}
    assert len(seen) >= 3, f"the batch should exercise several accept counts, saw {sorted(seen)}"
    assert dcp_arm["verify_all_gathers"] == [4], "verify: one all-gather per latent attention layer"
    assert dcp_arm["paged_graphs"] == ([4, 4] if paging else [0, 0]), "each layer's prefix reads pages, or none does"
    assert dcp_arm["collectives"]["draft"] == [0, 0, 0]
