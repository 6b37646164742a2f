"""An independent EAGLE3 / EAGLE-1 draft forward over published checkpoint tensors.

Written from the official code's idiom (EAGLE's ``cnets.py`` / ``cnets1.py``, the
engines' ``llama_eagle3.py``): Hugging Face names, rotate-half RoPE with
``cat(freqs, freqs)``, ``repeat_kv`` for GQA, a causal mask over one whole sequence, no
cache.  It shares no code with ``dcp_compile``: it is what ``EagleDraft.from_pretrained``
is checked against.  Also a writer of random checkpoints in the published layouts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def inverse_frequencies(config: dict, head_dim: int) -> torch.Tensor:
    """As transformers' default and ``llama3`` / ``linear`` rope initialisations compute them."""
    params = config.get("rope_parameters") or {}
    base = config.get("rope_theta", params.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _attention(x, sd, prefix, config, positions):
    B, T, _ = x.shape
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads
    q = F.linear(x, sd[f"{prefix}.q_proj.weight"]).view(B, T, heads, hd).transpose(1, 2)
    k = F.linear(x, sd[f"{prefix}.k_proj.weight"]).view(B, T, kv_heads, hd).transpose(1, 2)
    v = F.linear(x, sd[f"{prefix}.v_proj.weight"]).view(B, T, kv_heads, hd).transpose(1, 2)
    freqs = positions[:, :, None].float() * inverse_frequencies(config, hd)[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = q @ k.transpose(2, 3) / math.sqrt(hd)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
    return F.linear(out.transpose(1, 2).reshape(B, T, -1), sd[f"{prefix}.o_proj.weight"])


def _mlp(x, sd, prefix):
    gate = F.linear(x, sd[f"{prefix}.gate_proj.weight"])
    return F.linear(F.silu(gate) * F.linear(x, sd[f"{prefix}.up_proj.weight"]), sd[f"{prefix}.down_proj.weight"])


def eagle3_forward(sd: dict, config: dict, embed_weight, input_ids, features):
    """Logits over the target vocabulary (-inf outside the draft's) and the pre-norm hidden
    state, for one whole sequence per row at positions ``0..T-1``."""
    eps = config["rms_norm_eps"]
    B, T = input_ids.shape
    positions = torch.arange(T)[None].expand(B, T)
    inputs_embeds = F.embedding(input_ids, embed_weight)
    hidden = F.linear(features, sd["fc.weight"], sd.get("fc.bias"))
    residual = hidden
    x = torch.cat([rms_norm(inputs_embeds, sd["midlayer.input_layernorm.weight"], eps),
                   rms_norm(hidden, sd["midlayer.hidden_norm.weight"], eps)], dim=-1)
    hidden = residual + _attention(x, sd, "midlayer.self_attn", config, positions)
    residual = hidden
    hidden = residual + _mlp(rms_norm(hidden, sd["midlayer.post_attention_layernorm.weight"], eps), sd, "midlayer.mlp")
    draft_logits = F.linear(rms_norm(hidden, sd["norm.weight"], eps), sd["lm_head.weight"])
    vocab = config["vocab_size"]
    d2t = sd.get("d2t", torch.zeros(draft_logits.shape[-1], dtype=torch.long))
    logits = torch.full((B, T, vocab), float("-inf"))
    logits[..., torch.arange(draft_logits.shape[-1]) + d2t] = draft_logits
    return logits, hidden


def eagle1_forward(sd: dict, config: dict, embed_weight, head_weight, input_ids, features):
    """EAGLE-1: ``fc(cat(embed, feature))``, a layer without input norm, the target's head
    on the un-normed output."""
    eps = config["rms_norm_eps"]
    B, T = input_ids.shape
    positions = torch.arange(T)[None].expand(B, T)
    inputs_embeds = F.embedding(input_ids, sd.get("embed_tokens.weight", embed_weight))
    hidden = F.linear(torch.cat((inputs_embeds, features), dim=-1), sd["fc.weight"], sd.get("fc.bias"))
    hidden = hidden + _attention(hidden, sd, "layers.0.self_attn", config, positions)
    hidden = hidden + _mlp(rms_norm(hidden, sd["layers.0.post_attention_layernorm.weight"], eps), sd, "layers.0.mlp")
    return F.linear(hidden, head_weight), hidden


def random_eagle3(directory: Path, *, target_dim: int, vocab: int, draft_vocab: int, heads: int, kv_heads: int,
                  head_dim: int | None, intermediate: int, n_features: int = 3, embed: bool, seed: int,
                  extra_config: dict | None = None, fmt: str = "safetensors", dim: int | None = None) -> tuple[dict, dict]:
    """A random EAGLE3 checkpoint in the published layout; returns (state, config)."""
    gen = torch.Generator().manual_seed(seed)
    dim = dim or target_dim
    hd = head_dim or dim // heads

    def w(*shape, std=0.08):
        return std * torch.randn(*shape, generator=gen)

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    sd = {
        "fc.weight": w(dim, n_features * target_dim),
        "midlayer.input_layernorm.weight": norm(dim),
        "midlayer.hidden_norm.weight": norm(dim),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * dim, std=0.3),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * hd, 2 * dim, std=0.3),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * hd, 2 * dim),
        "midlayer.self_attn.o_proj.weight": w(dim, heads * hd),
        "midlayer.post_attention_layernorm.weight": norm(dim),
        "midlayer.mlp.gate_proj.weight": w(intermediate, dim),
        "midlayer.mlp.up_proj.weight": w(intermediate, dim),
        "midlayer.mlp.down_proj.weight": w(dim, intermediate),
        "norm.weight": norm(dim),
        "lm_head.weight": w(draft_vocab, dim, std=0.5),
    }
    if draft_vocab != vocab:
        used = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        sd["d2t"] = used - torch.arange(draft_vocab)
        sd["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, used, True)
    if embed:
        sd["embed_tokens.weight"] = w(vocab, dim, std=1.0)
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=dim,
                  intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  num_hidden_layers=1, rms_norm_eps=1e-5, vocab_size=vocab, draft_vocab_size=draft_vocab,
                  hidden_act="silu", tie_word_embeddings=False, max_position_embeddings=2048,
                  **({"head_dim": head_dim} if head_dim else {}),
                  **({"target_hidden_size": target_dim} if dim != target_dim else {}), **(extra_config or {}))
    _write(directory, sd, config, fmt)
    return sd, config


def random_eagle1(directory: Path, *, dim: int, vocab: int, heads: int, kv_heads: int, intermediate: int,
                  bias: bool, embed: bool, seed: int, extra_config: dict | None = None) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(seed)
    hd = dim // heads

    def w(*shape, std=0.08):
        return std * torch.randn(*shape, generator=gen)

    sd = {
        "fc.weight": w(dim, 2 * dim, std=0.3),
        "layers.0.self_attn.q_proj.weight": w(heads * hd, dim, std=0.3),
        "layers.0.self_attn.k_proj.weight": w(kv_heads * hd, dim, std=0.3),
        "layers.0.self_attn.v_proj.weight": w(kv_heads * hd, dim),
        "layers.0.self_attn.o_proj.weight": w(dim, heads * hd),
        "layers.0.post_attention_layernorm.weight": 1.0 + 0.1 * torch.randn(dim, generator=gen),
        "layers.0.mlp.gate_proj.weight": w(intermediate, dim),
        "layers.0.mlp.up_proj.weight": w(intermediate, dim),
        "layers.0.mlp.down_proj.weight": w(dim, intermediate),
    }
    if bias:
        sd["fc.bias"] = w(dim, std=0.5)
    if embed:
        sd["embed_tokens.weight"] = w(vocab, dim, std=1.0)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=dim, intermediate_size=intermediate,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=1, rms_norm_eps=1e-5,
                  vocab_size=vocab, hidden_act="silu", **({} if bias else {"bias": False}), **(extra_config or {}))
    _write(directory, sd, config, "safetensors")
    return sd, config


def _write(directory: Path, sd: dict, config: dict, fmt: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in sd.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(directory / "model.safetensors"))
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
