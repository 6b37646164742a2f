"""A reference target with multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi-K2).

Written the way serving code writes MLA decode, knowing nothing of DCP: the "absorbed"
form, which caches one shared latent head per token instead of per-head keys and
values.  Per layer, for new tokens ``x [B, T, dim]`` at ``positions [B, T]``:

    q_nope, q_pe = split(wq(x))                    # [B, T, H, nope], [B, T, H, rope]
    c_kv, k_pe   = split(wkv_a(x))                  # [B, T, C], [B, T, rope]
    kv_cache[b, pos] = norm(c_kv); pe_cache[b, pos] = rope(k_pe)
    q_abs  = q_nope @ W_uk                          # W_uk, W_uv: slices of wkv_b, [H, nope | v, C]
    scores = (q_abs . kv_cache + rope(q_pe) . pe_cache) * scale, masked causal by position
    o_lat  = softmax(scores) @ kv_cache             # the values are the latent itself
    out    = wo(o_lat @ W_uv)

``C = kv_lora_rank`` (512 in DeepSeek-V2/V3) and ``rope = qk_rope_head_dim`` (64): the
cache holds ``C + rope`` numbers per token and layer, for all heads together, which
tensor parallelism cannot split and decode context parallelism can.

``MLAttention.forward_uncached`` computes the same attention the textbook way
(per-head keys ``[k_nope | k_pe]`` and values decompressed from the latent): the
reference the absorbed form is tested against.  Under DCP the passes find the absorbed
einsums, shard both latent caches along the sequence, and run each layer as one key
head ``[latent | rope key]`` with the latent as values through the prefix + window +
exact-merge cascade (one collective per layer, the ``W_uv`` projection after the merge).
``draft_config`` sizes an EAGLE3 draft for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile.models.llama import DecoderStack, RMSNorm, apply_rope


@dataclass(frozen=True)
class MLAConfig:
    vocab_size: int = 256
    dim: int = 64
    """Model width."""
    n_layers: int = 2
    n_heads: int = 4
    q_lora_rank: int = 0
    """Rank of the query's low-rank projection (DeepSeek-V3: 1536); 0: a full ``wq``."""
    kv_lora_rank: int = 32
    """``C``: width of the shared latent the cache holds (DeepSeek-V2/V3: 512)."""
    qk_nope_head_dim: int = 16
    """Per-head query/key width without rotary embedding (DeepSeek: 128)."""
    qk_rope_head_dim: int = 8
    """Width of the rotary part, one shared key per token (DeepSeek: 64)."""
    v_head_dim: int = 16
    """Per-head value width (DeepSeek: 128)."""
    intermediate_size: int = 128
    """Dense SwiGLU width."""
    max_seq_len: int = 64
    max_batch: int = 3
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    aux_layers: tuple[int, ...] = ()
    """Hidden states returned beside the logits for EAGLE drafts, as ``LlamaConfig``'s."""
    attention_form: str = "einsum"
    """How the absorbed attention is spelled: ``"einsum"`` (DeepSeek's reference decode)
    or ``"sdpa"`` (one SDPA call, keys ``[latent | rope]``, the latent as values)."""

    def __post_init__(self) -> None:
        if self.attention_form not in ("einsum", "sdpa"):
            raise ValueError(f"attention_form must be 'einsum' or 'sdpa', got {self.attention_form!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (pairs rotate together), got {self.qk_rope_head_dim}")
        if any(not 0 <= i <= self.n_layers for i in self.aux_layers) or list(self.aux_layers) != sorted(set(self.aux_layers)):
            raise ValueError(
                f"aux_layers must be increasing layer indices in [0, n_layers={self.n_layers}], got {self.aux_layers}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Numbers the KV cache holds per token and layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def deepseek_v2_lite_shape(n_layers: int = 27, **overrides) -> MLAConfig:
    """DeepSeek-V2-Lite's attention: hidden 2048, 16 heads, no query low rank, latent 512,
    rope 64; a dense MLP sized to its about 2.4B active parameters stands in for the MoE."""
    return MLAConfig(**dict(dict(
        vocab_size=102400, dim=2048, n_layers=n_layers, n_heads=16, q_lora_rank=0, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=10944,
    ), **overrides))


def deepseek_v3_attention_shape(n_layers: int = 61, **overrides) -> MLAConfig:
    """DeepSeek-V3's attention: hidden 7168, 128 heads, query low rank 1536, latent 512,
    rope 64 (its MoE is replaced by a dense MLP of the shared expert's width)."""
    return MLAConfig(**dict(dict(
        vocab_size=129280, dim=7168, n_layers=n_layers, n_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432,
    ), **overrides))


def draft_config(cfg: MLAConfig, kind: str = "eagle3", **options):
    """A ``DraftConfig`` for an EAGLE draft of an MLA target: a Llama decoder layer of the
    target's width and heads over its hidden states (as Kimi-K2.5's EAGLE3 drafts are),
    with the target's vocabulary, cache size and EAGLE3 features; ``options`` go to
    ``DraftConfig`` (``draft_vocab_size``, ``n_features``)."""
    from dcp_compile.models.eagle import DraftConfig
    from dcp_compile.models.llama import LlamaConfig

    if cfg.dim % cfg.n_heads:
        raise ValueError(f"a Llama draft layer needs dim ({cfg.dim}) divisible by n_heads ({cfg.n_heads})")
    shapes = LlamaConfig(
        vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
        intermediate_size=cfg.intermediate_size, max_seq_len=cfg.max_seq_len, max_batch=cfg.max_batch,
        rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, aux_layers=cfg.aux_layers,
    )
    return DraftConfig(shapes, kind, **options)


class MLAttention(nn.Module):
    def __init__(self, cfg: MLAConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        H = cfg.n_heads
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, H * cfg.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(H * cfg.v_head_dim, cfg.dim, bias=False)
        self.n_local_heads = H
        """The query heads this rank holds: all of them, until ``tensor_parallel`` shards the layer."""
        self.softmax_scale = 1.0 / math.sqrt(cfg.qk_head_dim)
        self.cache_dtype = dtype
        self.register_buffer("kv_cache", None, persistent=False)
        self.register_buffer("pe_cache", None, persistent=False)

    def allocate_cache(self, device) -> None:
        cfg = self.cfg
        for name, width in (("kv_cache", cfg.kv_lora_rank), ("pe_cache", cfg.qk_rope_head_dim)):
            self.register_buffer(name, torch.zeros(cfg.max_batch, cfg.max_seq_len, width, dtype=self.cache_dtype,
                                                   device=device), persistent=False)

    def _queries(self, x, cos, sin):
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if cfg.q_lora_rank else self.wq(x)
        q_nope, q_pe = q.view(B, T, self.n_local_heads, cfg.qk_head_dim).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        return q_nope, apply_rope(q_pe, cos, sin)

    def _latents(self, x, cos, sin):
        c_kv, k_pe = self.wkv_a(x).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], -1)
        return self.kv_norm(c_kv), apply_rope(k_pe, cos, sin)

    def _up_projections(self):
        cfg = self.cfg
        wkv_b = self.wkv_b.weight.view(self.n_local_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return wkv_b[:, : cfg.qk_nope_head_dim], wkv_b[:, cfg.qk_nope_head_dim :]  # W_uk, W_uv: [H, nope | v, C]

    def forward(self, x, positions, cos, sin):
        B, T, _ = x.shape
        q_nope, q_pe = self._queries(x, cos, sin)
        c_kv, k_pe = self._latents(x, cos, sin)
        rows = torch.arange(B, device=x.device)[:, None]
        self.kv_cache[rows, positions] = c_kv
        self.pe_cache[rows, positions] = k_pe
        w_uk, w_uv = self._up_projections()
        q_abs = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)
        if self.cfg.attention_form == "sdpa":
            slots = torch.arange(self.kv_cache.shape[1], device=x.device)
            visible = slots[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
            q = torch.cat([q_abs, q_pe], dim=-1).transpose(1, 2)  # [B, H, T, C + rope]
            keys = torch.cat([self.kv_cache, self.pe_cache], dim=-1)[:, None]
            o_lat = F.scaled_dot_product_attention(q, keys, self.kv_cache[:, None], attn_mask=visible,
                                                   scale=self.softmax_scale, enable_gqa=True).transpose(1, 2)
            return self.wo(torch.einsum("bthc,hdc->bthd", o_lat.type_as(x), w_uv).flatten(2))
        scores = (torch.einsum("bthc,bsc->bths", q_abs, self.kv_cache)
                  + torch.einsum("bthr,bsr->bths", q_pe, self.pe_cache)) * self.softmax_scale
        slots = torch.arange(self.kv_cache.shape[1], device=x.device)
        visible = slots[None, None, None, :] <= positions[:, :, None, None]  # [B, T, 1, S]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1, dtype=torch.float32).type_as(x)
        o_lat = torch.einsum("bths,bsc->bthc", probs, self.kv_cache)
        return self.wo(torch.einsum("bthc,hdc->bthd", o_lat, w_uv).flatten(2))

    def forward_uncached(self, x, cos, sin):
        """Causal attention within ``x`` with per-head keys and values decompressed from
        the latent, no cache: the textbook form of the same attention."""
        cfg = self.cfg
        B, T, _ = x.shape
        q_nope, q_pe = self._queries(x, cos, sin)
        c_kv, k_pe = self._latents(x, cos, sin)
        w_uk, w_uv = self._up_projections()
        k_nope = torch.einsum("btc,hdc->bthd", c_kv, w_uk)
        v = torch.einsum("btc,hdc->bthd", c_kv, w_uv)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(B, T, self.n_local_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).flatten(2))


class MLATransformer(DecoderStack):
    """``forward(tokens [B, T], positions [B, T], logits_at=None)`` as ``Llama``'s: fp32
    logits, and the EAGLE features of ``aux_layers`` when set; ``forward_uncached`` runs the
    textbook (decompressed) attention."""

    def __init__(self, cfg: MLAConfig, *, dtype: torch.dtype = torch.float32, device=None, cache_device=None):
        super().__init__()
        self._build(cfg, (MLAttention(cfg, dtype) for _ in range(cfg.n_layers)), cfg.qk_rope_head_dim,
                    dtype=dtype, device=device, cache_device=cache_device)
