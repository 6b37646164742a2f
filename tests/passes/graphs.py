"""Small attention modules in the idioms the passes must recognise (or refuse)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

B, HQ, HKV, S, D = 2, 4, 2, 16, 8


class Projections(nn.Module):
    """Query and key/value projections plus two cache buffers of ``cache_shape``."""

    def __init__(self, cache_shape=(B, HKV, S, D), names=("k_cache", "v_cache")):
        super().__init__()
        self.wq = nn.Linear(D, HQ * D, bias=False)
        self.wkv = nn.Linear(D, 2 * HKV * D, bias=False)
        for name in names:
            self.register_buffer(name, torch.zeros(cache_shape))

    def project(self, x):
        """``q [B, HQ, T, D]`` and ``k, v [B, T, HKV, D]``."""
        T = x.shape[1]
        q = self.wq(x).view(B, T, HQ, D).transpose(1, 2)
        k, v = self.wkv(x).view(B, T, 2 * HKV, D).split(HKV, dim=2)
        return q, k, v


class GptFastStyle(Projections):
    """gpt-fast: ``k_out[:, :, input_pos] = k``, a causal-mask buffer indexed by input_pos,
    repeat_interleave GQA."""

    def __init__(self):
        super().__init__()
        self.register_buffer("causal_mask", torch.tril(torch.ones(S, S, dtype=torch.bool)))

    def store(self, x, input_pos):
        """Project and store the new keys/values; returns ``q, k, v`` with heads on axis 1."""
        q, k, v = self.project(x)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return q, k, v

    def forward(self, x, input_pos):
        q, _, _ = self.store(x, input_pos)
        mask = self.causal_mask[None, None, input_pos]
        keys = self.k_cache.repeat_interleave(HQ // HKV, dim=1)
        values = self.v_cache.repeat_interleave(HQ // HKV, dim=1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class IndexCopyStyle(Projections):
    """Hugging Face StaticCache: ``index_copy_(2, cache_position, k)``, expand + reshape GQA."""

    def __init__(self):
        super().__init__(names=("keys", "values"))

    def forward(self, x, cache_position):
        q, k, v = self.project(x)
        self.keys.index_copy_(2, cache_position, k.transpose(1, 2))
        self.values.index_copy_(2, cache_position, v.transpose(1, 2))
        slen = self.keys.shape[2]
        mask = torch.arange(slen)[None, :] <= cache_position[:, None]
        n_rep = HQ // HKV
        keys = self.keys[:, :, None, :, :].expand(B, HKV, n_rep, slen, D).reshape(B, HQ, slen, D)
        values = self.values[:, :, None, :, :].expand(B, HKV, n_rep, slen, D).reshape(B, HQ, slen, D)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None, None])


class IndexPutBSHD(Projections):
    """A ``[B, S, H, D]`` cache written by ``index_put_((rows, positions), k)``; enable_gqa."""

    def __init__(self):
        super().__init__(cache_shape=(B, S, HKV, D))

    def forward(self, x, positions):
        q, k, v = self.project(x)
        rows = torch.arange(B)[:, None]
        self.k_cache.index_put_((rows, positions), k)
        self.v_cache.index_put_((rows, positions), v)
        mask = torch.arange(self.k_cache.shape[1])[None, None, None, :] <= positions[:, None, :, None]
        return F.scaled_dot_product_attention(
            q, self.k_cache.transpose(1, 2), self.v_cache.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )


class NoCache(nn.Module):
    """Attention over keys and values computed in the graph: not a cache read."""

    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(D, 3 * HQ * D, bias=False)

    def forward(self, x, positions):
        T = x.shape[1]
        q, k, v = self.wqkv(x).view(B, T, 3 * HQ, D).transpose(1, 2).split(HQ, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CacheThenConcat(GptFastStyle):
    """Attention over ``cat([cache, new])``: a cache read the passes cannot classify."""

    def forward(self, x, input_pos):
        q, k, v = self.store(x, input_pos)
        keys = torch.cat([self.k_cache, k], dim=2)  # UNCLASSIFIABLE-READ
        values = torch.cat([self.v_cache, v], dim=2)
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)


class HandWrittenGptFast(GptFastStyle):
    """nanoGPT-style attention by hand over gpt-fast's cache: a scaled matmul, the
    causal-mask buffer as masked_fill(~mask, -inf), softmax in fp32, a matmul with V."""

    def forward(self, x, input_pos):
        q, _, _ = self.store(x, input_pos)
        mask = self.causal_mask[None, None, input_pos]
        keys = self.k_cache.repeat_interleave(HQ // HKV, dim=1)
        values = self.v_cache.repeat_interleave(HQ // HKV, dim=1)
        scores = q @ keys.transpose(-2, -1) / math.sqrt(D)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        return probs @ values  # HAND-WRITTEN


class HandWrittenHFEager(IndexCopyStyle):
    """Hugging Face's eager_attention_forward over a StaticCache: repeat_kv, matmul times
    ``scaling``, an additive mask, softmax in fp32 cast back, matmul with the values."""

    def forward(self, x, cache_position):
        q, k, v = self.project(x)
        self.keys.index_copy_(2, cache_position, k.transpose(1, 2))
        self.values.index_copy_(2, cache_position, v.transpose(1, 2))
        slen = self.keys.shape[2]
        allowed = torch.arange(slen)[None, :] <= cache_position[:, None]
        causal_mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
        n_rep = HQ // HKV
        key_states = self.keys[:, :, None, :, :].expand(B, HKV, n_rep, slen, D).reshape(B, HQ, slen, D)
        value_states = self.values[:, :, None, :, :].expand(B, HKV, n_rep, slen, D).reshape(B, HQ, slen, D)
        attn_weights = torch.matmul(q, key_states.transpose(2, 3)) * D**-0.5
        attn_weights = attn_weights + causal_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(attn_weights, value_states)


class SoftmaxOverQueries(GptFastStyle):
    """Hand-written attention whose softmax runs over the queries: not attention over keys."""

    def forward(self, x, input_pos):
        q, _, _ = self.store(x, input_pos)
        mask = self.causal_mask[None, None, input_pos]
        scores = (q[:, :HKV] @ self.k_cache.transpose(-2, -1)).masked_fill(~mask, float("-inf"))
        return scores.softmax(2) @ self.v_cache  # WRONG-AXIS


class FilledWithoutInversion(GptFastStyle):
    """masked_fill with the keep-mask itself: a fill the passes do not read."""

    def forward(self, x, input_pos):
        q, _, _ = self.store(x, input_pos)
        mask = self.causal_mask[None, None, input_pos]
        scores = (q[:, :HKV] @ self.k_cache.transpose(-2, -1)).masked_fill(mask == 0, float("-inf"))  # FILL
        return scores.softmax(-1) @ self.v_cache


class MatmulOverCache(GptFastStyle):
    """Hand-written attention over the cache with no mask: found, but not provably causal."""

    def forward(self, x, input_pos):
        q, _, _ = self.store(x, input_pos)
        scores = q[:, :HKV] @ self.k_cache.transpose(-1, -2)
        return scores.softmax(-1) @ self.v_cache  # UNMASKED-MATMUL


class ScoresOverCache(GptFastStyle):
    """Scores against the cached keys that never weigh the values: not attention."""

    def forward(self, x, input_pos):
        q, _, _ = self.store(x, input_pos)
        return (q[:, :HKV] @ self.k_cache.transpose(-1, -2)).amax(-1)  # MATMUL-READ


def inputs_for(module: nn.Module, tokens: int = 3):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, tokens, D, generator=gen)
    if isinstance(module, (IndexPutBSHD, NoCache)):
        return x, torch.arange(5, 5 + tokens).expand(B, tokens).contiguous()
    return x, torch.arange(5, 5 + tokens)


def line_of(marker: str) -> int:
    """Line number of ``marker`` in this file, for checking that errors name the user's line."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line)
