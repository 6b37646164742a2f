"""The speculative-decoding gate with a Hugging Face target: EAGLE3 chain drafts on a
DCP group give the off arm's tokens and accept counts exactly."""

import pytest

from dcp_compile.runtime.launch import spawn_ranks

pytest.importorskip("transformers")

from tests.hf.workers import hf_spec_worker  # noqa: E402

K, NOISE = 3, 3.0


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_hf_eagle3_gate(family):
    """``deepseek_v3``: transformers' multi-head latent attention as the target, its
    latent cache sharded, verify graphs parking the chain in staging slots.  Llama's DCP
    arm keeps its target caches paged, in a pool that holds three of the four requests at once."""
    ranks = spawn_ranks(hf_spec_worker, 2, K, 16, NOISE, family, timeout=600)
    off, results = ranks[0]["off"], [r["dcp"] for r in ranks]
    for r in results:
        assert r["tokens"] == off["tokens"] and r["accepted"] == off["accepted"]
    seen = {a for row in off["accepted"] for a in row}
    assert len(seen) >= 3, f"the batch must exercise several accept counts, saw {sorted(seen)}"
    assert all(len(t) == 16 for t in off["tokens"])
    assert results[0]["verify_all_gathers"] == [4], "verify: one all-gather per HF decoder layer"
    assert results[0]["draft_collectives"] == [0, 0, 0]
    assert off["verify_all_gathers"] == [0], "the off arm is plain torch.compile"
    assert results[0]["paged"] == (family == "llama") and not off["paged"]
