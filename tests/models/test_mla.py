"""The reference MLA target: the absorbed, latent-cache decode computes the textbook
attention, step by step, for every sequence at its own positions."""

import pytest
import torch

from dcp_compile.models.llama import init_weights
from dcp_compile.models.mla import MLAConfig, MLATransformer, deepseek_v2_lite_shape, deepseek_v3_attention_shape


def model(cfg: MLAConfig, seed: int = 0) -> MLATransformer:
    return init_weights(MLATransformer(cfg, dtype=torch.float64), seed, std=0.2).eval()


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_absorbed_prefill_equals_decompressed_attention(q_lora_rank):
    cfg = MLAConfig(q_lora_rank=q_lora_rank)
    sdpa = model(MLAConfig(q_lora_rank=q_lora_rank, attention_form="sdpa"))
    m = model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.max_batch, 11), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(11).expand(cfg.max_batch, 11)
    with torch.no_grad():
        cached = m(tokens, positions)
        textbook = m.forward_uncached(tokens)
        spelled_sdpa = sdpa(tokens, positions)
    torch.testing.assert_close(cached, textbook, rtol=1e-5, atol=1e-5)  # the logits and the softmax are fp32 by design
    torch.testing.assert_close(spelled_sdpa, textbook, rtol=1e-5, atol=1e-5)


def test_decode_steps_at_ragged_positions_equal_recomputing_each_sequence():
    cfg = MLAConfig(aux_layers=(1, 2))
    m = model(cfg, seed=3)
    gen = torch.Generator().manual_seed(2)
    lengths = [4, 9, 13]
    seqs = [torch.randint(0, cfg.vocab_size, (n + 6,), generator=gen) for n in lengths]
    width = max(lengths)
    prompt = torch.zeros(cfg.max_batch, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        prompt[row, :n] = seqs[row][:n]
    with torch.no_grad():
        m(prompt, torch.arange(width).expand(cfg.max_batch, width))  # right-padded prefill
        for step in range(6):
            tokens = torch.stack([s[n + step] for s, n in zip(seqs, lengths)])[:, None]
            positions = torch.tensor(lengths)[:, None] + step
            logits, features = m(tokens, positions)
            for row, n in enumerate(lengths):
                full_logits, full_features = m.forward_uncached(seqs[row][None, : n + step + 1])
                torch.testing.assert_close(logits[row, 0], full_logits[0, -1], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(features[row, 0], full_features[0, -1], rtol=1e-5, atol=1e-5)
    assert m.feature_width == 2 * cfg.dim and m.vocab_size == cfg.vocab_size


def test_the_cache_holds_one_latent_head_per_token():
    cfg = MLAConfig()
    m = MLATransformer(cfg)
    attention = m.layers[0].attention
    assert attention.kv_cache.shape == (cfg.max_batch, cfg.max_seq_len, cfg.kv_lora_rank)
    assert attention.pe_cache.shape == (cfg.max_batch, cfg.max_seq_len, cfg.qk_rope_head_dim)
    assert deepseek_v2_lite_shape().cache_width == 576 and deepseek_v3_attention_shape().cache_width == 576
    assert deepseek_v3_attention_shape().q_lora_rank == 1536 and deepseek_v2_lite_shape().n_heads == 16


def test_logits_at_picks_each_rows_position():
    cfg = MLAConfig()
    m = model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.max_batch, 7), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(7).expand(cfg.max_batch, 7)
    at = torch.tensor([[6], [2], [4]])
    with torch.no_grad():
        full = m(tokens, positions)
        picked = m(tokens, positions, at)
    torch.testing.assert_close(picked[:, 0], full[torch.arange(3), at[:, 0]], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("size, interleave, form", [(1, 1, "einsum"), (2, 1, "einsum"), (2, 2, "einsum"),
                                                    (3, 1, "einsum"), (2, 1, "sdpa")])
def test_mla_target_shards_and_matches_itself_unsharded(size, interleave, form):
    """Prefill (ragged, right-padded) and 20 decode steps at per-sequence positions."""
    import math

    from dcp_compile.runtime.launch import spawn_ranks
    from tests.runtime.workers import mla_parity_worker
    from tests.support import FP32_TOLERANCE

    ranks = spawn_ranks(mla_parity_worker, size, interleave, 20, form, timeout=600)
    for r in ranks:
        for out, ref in zip(r["outs"], r["refs"]):
            torch.testing.assert_close(out, ref, **FP32_TOLERANCE)
    slots = 40 if size == 1 else math.ceil(40 / (interleave * size)) * interleave + 1
    cfg = MLAConfig()
    assert ranks[0]["caches"] == {
        f"layers.{i}.attention.{name}": (3, slots, width)
        for i in range(cfg.n_layers) for name, width in (("kv_cache", cfg.kv_lora_rank), ("pe_cache", cfg.qk_rope_head_dim))
    }
    assert ranks[0]["collectives"] == [2 * cfg.n_layers if size > 1 else 0] * 2, "one all-gather + wait per layer"


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double()])
def test_casting_the_model_after_construction_keeps_fp32_rope_tables(cast):
    """A user's ``model.to(torch.bfloat16)`` casts every floating buffer; the rotation
    tables must stay the fp32 ones, or every position's rotation is rounded."""
    from dcp_compile.models.llama import Llama, LlamaConfig

    for built in (MLATransformer(MLAConfig()), Llama(LlamaConfig())):
        fresh_cos, fresh_sin = built.rope_cos.clone(), built.rope_sin.clone()
        cast(built)
        assert built.rope_cos.dtype == built.rope_sin.dtype == torch.float32, type(built).__name__
        assert torch.equal(built.rope_cos, fresh_cos) and torch.equal(built.rope_sin, fresh_sin)
        assert built.output.weight.dtype != torch.float32
