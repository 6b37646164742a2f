"""Hugging Face models under DCP against themselves unsharded and eager, on gloo ranks."""

import pytest
import torch

from dcp_compile.runtime.launch import spawn_ranks
from tests.support import FP32_TOLERANCE

pytest.importorskip("transformers")

from dcp_compile.hf import cache_widths  # noqa: E402
from tests.hf.workers import MAX_SEQ_LEN, RAGGED_LENGTHS, hf_config, hf_parity_worker  # noqa: E402

STEPS = 4


def assert_parity(ranks, family):
    results = [r[family] for r in ranks]
    for rank, r in enumerate(results):
        for kind in ("", "ragged_") if "ragged_tokens" in r else ("",):
            assert torch.equal(r[f"{kind}tokens"], r[f"reference_{kind}tokens"]), f"rank {rank}: {kind}tokens differ"
            torch.testing.assert_close(r[f"{kind}logits"], r[f"reference_{kind}logits"], **FP32_TOLERANCE)
            assert torch.equal(r[f"{kind}logits"], results[0][f"{kind}logits"]), "ranks must agree bitwise"


# (family, also through DCPCausalLM with ragged prompts); one spawn per group size keeps CI short.
FAMILIES = {
    2: (("llama", True), ("qwen2", False)),
    3: (("qwen2", True), ("llama", False)),
}


def check_families(size, families):
    """Each ``(family, wrapped)`` on ``size`` ranks against itself unsharded: tokens and
    logits, this rank's cache shard, one collective per layer in the prefill and decode
    graphs; the ragged prompts through DCPCausalLM where ``wrapped``."""
    ranks = spawn_ranks(hf_parity_worker, size, families, "aot_eager", STEPS, timeout=600)
    local = -(-MAX_SEQ_LEN // size) + 1
    for family, wrapped in families:
        assert_parity(ranks, family)
        r = ranks[0][family]
        (kv_heads, width), _ = cache_widths(hf_config(family))
        assert r["local_cache"] == (2, kv_heads, local, width), f"{family}: DCPStaticCache holds S_loc + 1 slots"
        assert r["collectives"] == [4, 4], f"{family}: prefill and decode graphs, all-gather + wait per layer"
        if wrapped:
            assert r["wrapper_cache"] == (len(RAGGED_LENGTHS), kv_heads, local, width), f"{family}: prepare shards it"
            assert r["wrapper_collectives"] == [4, 4], family


@pytest.mark.parametrize("size", [2, 3])
def test_hf_parity(size):
    """Llama and Qwen2; Mistral without a sliding window takes the same path (test_hf_errors)."""
    check_families(size, FAMILIES[size])


def test_more_hf_families():
    """Qwen3 (per-head q/k norms), Phi-3 (fused qkv and gate-up projections), Granite
    (scaled embeddings, residuals and logits), OLMo2 (norms after attention and MLP, q/k
    norms over all heads), Gemma (scaled embeddings, GeGLU), StableLM (rope on a quarter
    of each head), Cohere (attention and MLP in parallel, scaled logits), GPT-NeoX (fused
    qkv, parallel residual, no grouped KV heads) and Mixtral (a sparse mixture of experts):
    transformers' own files, in the user's StaticCache loop, two also through DCPCausalLM."""
    check_families(2, (("qwen3", True), ("phi3", False), ("granite", False), ("olmo2", True), ("gemma", False),
                       ("stablelm", False), ("cohere", False), ("gptneox", False), ("mixtral", False)))


def test_hf_latent_attention():
    """Multi-head latent attention as transformers writes it (DeepSeek-V3, and V2 without a
    query LoRA; also hand-written with attn_implementation="eager"; MiniCPM3; GLM-4 MoE
    Lite with interleaved rope pairs): the cache holds the 32-wide latent and the 8-wide
    rope key, sharded, and kv_b_proj expands this rank's slots per head at every step."""
    check_families(2, (("deepseek_v3", True), ("deepseek_v2", False), ("deepseek_v3_eager", False),
                       ("minicpm3", False), ("glm4_moe_lite", True)))


@pytest.mark.inductor
def test_hf_parity_inductor():
    assert_parity(spawn_ranks(hf_parity_worker, 2, (("llama", False),), "inductor", 3, timeout=900), "llama")


def test_hf_eager_attention_is_sharded():
    """attn_implementation="eager": transformers' hand-written attention, not SDPA."""
    from tests.hf.workers import hf_eager_worker

    for r in spawn_ranks(hf_eager_worker, 2, STEPS, timeout=600):
        assert torch.equal(r["tokens"], r["reference_tokens"])
        torch.testing.assert_close(r["logits"], r["reference_logits"], **FP32_TOLERANCE)
        assert r["collectives"] == [4, 4], "prefill and decode graphs: all-gather + wait per layer"
