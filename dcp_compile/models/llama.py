"""A reference Llama-family target: RMSNorm, RoPE, GQA, SwiGLU, static KV buffers.

Written the way serving code is written (gpt-fast style), so it is what the passes
must recognise: each layer owns ``k_cache``/``v_cache`` buffers ``[B, H_kv, S, D]``,
stores the new tokens at their global positions, and attends with
``F.scaled_dot_product_attention`` over the whole cache with a positions mask.

Positions are per sequence (``positions [B, T]``), so one batch can hold sequences of
different lengths.  A prefill of prompts of different lengths is right-padded: padded
tokens write garbage at positions past their prompt, which the causal mask hides and
the next real token at that position overwrites.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GQA_FORMS = ("enable_gqa", "repeat_interleave", "expand")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    """Token vocabulary (256: bytes)."""
    dim: int = 64
    """Model width."""
    n_layers: int = 2
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 2
    """Key/value heads; ``n_heads`` must be a multiple."""
    intermediate_size: int = 128
    """SwiGLU hidden width."""
    max_seq_len: int = 64
    """Cache capacity ``S`` per sequence."""
    max_batch: int = 3
    """Cache rows."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    gqa: str = "enable_gqa"
    """How attention maps query heads to KV heads: one of ``GQA_FORMS``."""
    aux_layers: tuple[int, ...] = ()
    """Hidden states to return beside the logits, for EAGLE drafts: index ``i < n_layers``
    is the hidden state entering layer ``i``; ``n_layers`` is the final normed hidden
    state the LM head reads.  Empty: ``forward`` returns the logits alone."""
    head_dim: int | None = None
    """Width of one query/key/value head; ``None``: ``dim // n_heads``.  A published EAGLE
    draft's config may give another (then ``n_heads * head_dim`` need not be ``dim``)."""
    rope_scaling: RopeScaling | None = None
    """RoPE frequency scaling (Llama-3.1's ``llama3`` or ``linear``); ``None``: plain RoPE.
    A dict in the config.json form is read into a ``RopeScaling``."""

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"need dim % n_heads == 0 (or an explicit head_dim), got dim={self.dim}, "
                                 f"n_heads={self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"need n_heads % n_kv_heads == 0, got dim={self.dim}, n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.gqa not in GQA_FORMS:
            raise ValueError(f"gqa must be one of {GQA_FORMS}, got {self.gqa!r}")
        if any(not 0 <= i <= self.n_layers for i in self.aux_layers) or list(self.aux_layers) != sorted(set(self.aux_layers)):
            raise ValueError(
                f"aux_layers must be increasing layer indices in [0, n_layers={self.n_layers}], got {self.aux_layers}"
            )


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face configs give it (``rope_scaling`` or
    ``rope_parameters``).

    ``llama3`` (Llama-3.1 and its 70B EAGLE3 drafts): wavelengths shorter than
    ``original_max_position_embeddings / high_freq_factor`` keep their frequency, those
    longer than ``... / low_freq_factor`` are slowed by ``factor``, and the band between
    blends the two linearly in ``original / wavelength``.  ``linear``: every frequency
    divided by ``factor`` (position interpolation)."""

    rope_type: str
    """``"llama3"`` or ``"linear"``."""
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    TYPES = ("llama3", "linear")

    def __post_init__(self) -> None:
        if self.rope_type not in self.TYPES:
            raise ValueError(f"RoPE scaling type {self.rope_type!r} is not implemented; implemented: {self.TYPES}")
        if self.factor <= 0 or (self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0):
            raise ValueError(f"RoPE scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got {self}")

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        if self.rope_type == "linear":
            return inv_freq / self.factor
        wavelength = 2 * math.pi / inv_freq
        original = self.original_max_position_embeddings
        blend = (original / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - blend) * inv_freq / self.factor + blend * inv_freq
        slow = torch.where(wavelength > original / self.low_freq_factor, inv_freq / self.factor, blended)
        return torch.where(wavelength < original / self.high_freq_factor, inv_freq, slow)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(dim: int, max_seq_len: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[max_seq_len, dim / 2]`` for every position the cache can hold."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if scaling is not None:
        inv_freq = scaling.scale(inv_freq)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


class RopeTables(nn.Module):
    """Keeps the ``rope_cos``/``rope_sin`` buffers in fp32 whatever dtype the weights are
    cast to: rounding the tables to bf16 would perturb every position's rotation."""

    def _init_rope(self, dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None) -> None:
        self._rope_shape = (dim, max_seq_len, theta, scaling)
        cos, sin = rope_tables(*self._rope_shape)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        device = self.rope_cos.device
        cos, sin = rope_tables(*self._rope_shape)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        return self


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs of the last axis of ``x [B, T, ..., D]`` (per-head queries and
    keys, or MLA's one shared rope key ``[B, T, D]``); ``cos``/``sin`` ``[B or 1, T, D/2]``."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    extra = x.dim() - 3
    cos, sin = (t.reshape(*t.shape[:2], *([1] * extra), t.shape[-1]) for t in (cos, sin))
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, in_features: int | None = None):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        in_features = in_features or cfg.dim
        self.wq = nn.Linear(in_features, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(in_features, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(in_features, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.n_local_heads, self.n_local_kv_heads = cfg.n_heads, cfg.n_kv_heads
        """The heads this rank holds: all of them, until ``tensor_parallel`` shards the layer."""
        self.cache_shape = (cfg.max_batch, cfg.n_kv_heads, cfg.max_seq_len, hd)
        self.cache_dtype = dtype
        # Allocated by the owning model once its weights are on their device (see
        # ``allocate_cache``), so that a cache left on meta never exists at full size.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def allocate_cache(self, device) -> None:
        for name in ("k_cache", "v_cache"):
            self.register_buffer(name, torch.zeros(self.cache_shape, dtype=self.cache_dtype, device=device),
                                 persistent=False)

    def project(self, x, cos, sin):
        """Rotated queries and keys, and values, of the new tokens: ``[B, T, H, D]`` each."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = apply_rope(self.wq(x).view(B, T, self.n_local_heads, cfg.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, self.n_local_kv_heads, cfg.head_dim), cos, sin)
        v = self.wv(x).view(B, T, self.n_local_kv_heads, cfg.head_dim)
        return q, k, v

    def forward_uncached(self, x, cos, sin):
        """Causal attention within ``x`` alone, touching no cache: the training path."""
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.project(x, cos, sin))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x, positions, cos, sin):
        cfg = self.cfg
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        rows = torch.arange(B, device=x.device)[:, None]
        self.k_cache[rows, :, positions] = k  # value [B, T, H_kv, D]: advanced indices go first
        self.v_cache[rows, :, positions] = v
        slots = torch.arange(self.k_cache.shape[2], device=x.device)
        mask = slots[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
        q = q.transpose(1, 2)
        keys, values = self.k_cache, self.v_cache
        group = self.n_local_heads // self.n_local_kv_heads
        if cfg.gqa == "enable_gqa":
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        else:
            if cfg.gqa == "repeat_interleave":
                keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            else:  # expand + reshape, as Hugging Face's repeat_kv does
                b, h, s, d = keys.shape
                keys = keys[:, :, None].expand(b, h, group, s, d).reshape(b, h * group, s, d)
                values = values[:, :, None].expand(b, h, group, s, d).reshape(b, h * group, s, d)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual layer around ``attention`` (Llama's GQA or MLA's latent attention)
    and a SwiGLU MLP."""

    def __init__(self, cfg, attention: nn.Module):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, positions, cos, sin):
        h = x + self.attention(self.attention_norm(x), positions, cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward_uncached(self, x, cos, sin):
        h = x + self.attention.forward_uncached(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class TargetFacts:
    """What ``SpecDecoder`` reads of a target (``runtime.spec.SpecTarget``), from its ``cfg``."""

    cfg: LlamaConfig

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def feature_width(self) -> int:
        """Width of the EAGLE features forward returns (0: it returns the logits alone)."""
        return self.cfg.dim * len(self.cfg.aux_layers)

    # What an EAGLE draft reads of the target it is loaded for (``draft_config.DraftHost``).

    @property
    def hidden_size(self) -> int:
        return self.cfg.dim

    @property
    def num_layers(self) -> int:
        return self.cfg.n_layers

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.cfg.aux_layers

    @property
    def cache_shape(self) -> tuple[int, int]:
        """``(max_batch, max_seq_len)``: the rows and positions of the caches."""
        return self.cfg.max_batch, self.cfg.max_seq_len

    def get_input_embeddings(self) -> nn.Embedding:
        return self.tok_embeddings

    def get_output_embeddings(self) -> nn.Linear:
        return self.output


class DecoderStack(TargetFacts, RopeTables):
    """What Llama and the MLA target share: embedding, ``layers`` of ``Block``, final
    norm, LM head, fp32 rope tables, and the forwards.

    ``forward(tokens [B, T], positions [B, T]) -> logits [B, T, vocab]`` (fp32), or
    ``(logits, aux [B, T, len(aux_layers) * dim])`` when ``cfg.aux_layers`` is set.

    ``forward(..., logits_at [B, K])`` computes the logits only at those indices of each
    row (``[B, K, vocab]``), as a prefill chunk needs only its last position's: the LM
    head over a whole long prompt would cost ``T x vocab`` fp32.  The EAGLE features
    still cover every position, since the draft's own prefill reads them all."""

    def _build(self, cfg, attentions, rope_dim: int, *, dtype, device, cache_device,
               rope_scaling: RopeScaling | None = None) -> None:
        """``cache_device="meta"`` defers the KV caches: ``dcp.prepare`` then allocates only
        this rank's shard (after checking that it fits), never the whole cache."""
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, attention) for attention in attentions)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._init_rope(rope_dim, cfg.max_seq_len, cfg.rope_theta, rope_scaling)
        self.to(device=device, dtype=dtype)
        for layer in self.layers:
            layer.attention.allocate_cache(cache_device if cache_device is not None else self.output.weight.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, logits_at: torch.Tensor | None = None):
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        hidden = []
        for i, layer in enumerate(self.layers):
            if i in self.cfg.aux_layers:
                hidden.append(x)
            x = layer(x, positions, cos, sin)
        return self._head(x, hidden, logits_at)

    def forward_uncached(self, tokens: torch.Tensor):
        """The same outputs for whole sequences starting at position 0, with no KV cache
        read or written: what training differentiates through, and the reference the
        cached forward is tested against."""
        T = tokens.shape[1]
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[None, :T], self.rope_sin[None, :T]
        hidden = []
        for i, layer in enumerate(self.layers):
            if i in self.cfg.aux_layers:
                hidden.append(x)
            x = layer.forward_uncached(x, cos, sin)
        return self._head(x, hidden)

    def _head(self, x: torch.Tensor, hidden: list[torch.Tensor], logits_at: torch.Tensor | None = None):
        x = self.norm(x)
        logits = self.output(x if logits_at is None else take_rows(x, logits_at)).float()
        if not self.cfg.aux_layers:
            return logits
        if self.cfg.n_layers in self.cfg.aux_layers:
            hidden.append(x)
        return logits, torch.cat(hidden, dim=-1)


class Llama(DecoderStack):
    """The GQA target: ``DecoderStack``'s forwards over Llama attention layers."""

    def __init__(self, cfg: LlamaConfig, *, dtype: torch.dtype = torch.float32, device=None, cache_device=None):
        super().__init__()
        self._build(cfg, (Attention(cfg, dtype) for _ in range(cfg.n_layers)), cfg.head_dim,
                    dtype=dtype, device=device, cache_device=cache_device, rope_scaling=cfg.rope_scaling)


def take_rows(x_BTF: torch.Tensor, index_BK: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b, j]]`` for every row: ``[B, K, F]``."""
    return x_BTF.gather(1, index_BK[:, :, None].expand(-1, -1, x_BTF.shape[-1]))


def init_weights(model: nn.Module, seed: int, std: float = 0.08) -> nn.Module:
    """Deterministic random weights, identical on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model


def llama3_8b_shape(aux_layers: tuple[int, ...] = (2, 16, 29)) -> LlamaConfig:
    """The Llama-3-8B shape (random weights are the user's business): 32 layers, width
    4096, 32 query / 8 KV heads, MLP 14336, vocabulary 128256; ``aux_layers`` for an
    EAGLE3 draft."""
    return LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                       rope_theta=500000.0, aux_layers=aux_layers)
