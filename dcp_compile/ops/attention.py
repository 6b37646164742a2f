"""Attention that also returns its log-sum-exp, over an explicitly masked key set.

``attention_with_lse`` is the reference implementation and the specification: plain
torch, computed in fp32 whatever the input dtype, compared against float64 in the
tests.  The two forms the passes insert are built on it:

- ``prefix_attention``: non-causal attention of the new queries over this rank's
  cached slots ``[0, kv_len_b)``; a ``torch.library`` custom op so that a GPU kernel
  can be registered for it without touching the passes (``triton_prefix.py`` does).
- ``window_attention``: attention of the new queries over the new keys/values still
  in hand, masked by their global positions (causal for prefill, decode and chain
  verify).

Shapes: ``q [B, Hq, T, D]``; keys and values ``[B, Hkv, S, D]`` with ``Hq = G * Hkv``;
query head ``h`` reads key/value head ``h // G`` (the layout ``repeat_interleave`` and
``enable_gqa`` produce).  ``lse`` is the natural log, fp32, ``[B, Hq, T]``; a query
that sees no key gets ``out = 0`` and ``lse = -inf``, decided by the mask, never by
the arithmetic.
"""

from __future__ import annotations

import torch


def attention_with_lse(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    allowed_BTS: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention returning ``(out fp32 [B,Hq,T,D], lse fp32 [B,Hq,T])``.

    ``allowed_BTS`` is a bool mask broadcastable to ``[B, T, S]``: True where query
    ``t`` may attend key ``s``.
    """
    B, Hq, T, D = q_BHTD.shape
    Hkv = k_BHSD.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    group = Hq // Hkv
    q = q_BHTD.float().reshape(B, Hkv, group, T, D)
    scores = torch.einsum("bkgtd,bksd->bkgts", q, k_BHSD.float()) * scale
    allowed = allowed_BTS[:, None, None, :, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf exactly where a row sees no key
    shift = torch.where(torch.isfinite(lse), lse, 0.0)
    probs = torch.exp(scores - shift.unsqueeze(-1))
    # A slot no query may see can hold anything (trash, never-written memory, NaN);
    # 0 * NaN would still poison the sum, so such values are zeroed, not just weighted 0.
    unseen = ~allowed_BTS.any(dim=-2)[:, None, :, None]
    out = torch.einsum("bkgts,bksd->bkgtd", probs, v_BHSD.float().masked_fill(unseen, 0.0))
    return out.reshape(B, Hq, T, D), lse.reshape(B, Hq, T)


@torch.library.custom_op("dcp::prefix_attention", mutates_args=())
def prefix_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B,Hq,T,D]`` over cache slots ``[0, kv_len[b])`` of ``[B,Hkv,S,D]``."""
    slots = torch.arange(k_cache.shape[2], device=k_cache.device)
    allowed = (slots[None, :] < kv_len[:, None])[:, None, :]  # [B, 1, S]
    return attention_with_lse(q, k_cache, v_cache, allowed, scale)


@prefix_attention.register_fake
def _prefix_attention_fake(q, k_cache, v_cache, kv_len, scale):
    B, H, T, D = q.shape
    return q.new_empty((B, H, T, D), dtype=torch.float32), q.new_empty((B, H, T), dtype=torch.float32)


def window_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, positions_BT: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the ``T`` new queries over the ``T`` new keys, causal by global position."""
    allowed = positions_BT[:, None, :] <= positions_BT[:, :, None]  # [B, T(query), T(key)]
    return attention_with_lse(q, k_new, v_new, allowed, scale)
