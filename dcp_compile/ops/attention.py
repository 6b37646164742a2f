"""Attention that also returns its log-sum-exp, over an explicitly masked key set.

``attention_with_lse`` is the reference implementation and the specification: plain
torch, computed in fp32 whatever the input dtype, compared against float64 in the
tests.  The two forms the passes insert are ``torch.library`` custom ops built on it,
so that a GPU kernel can be registered for each without touching the passes
(``triton_prefix.py`` and ``triton_flash.py`` do):

- ``prefix_attention``: non-causal attention of the new queries over this rank's
  cached slots ``[0, kv_len_b)``, or ``[kv_start_b, kv_len_b)`` under a left-padding
  mask (the slots before ``kv_start_b`` hold pad positions);
- ``window_attention``: attention of the new queries over the new keys/values still
  in hand, masked by their global positions (causal for prefill, decode and chain
  verify) or, for a tree verify, by an ancestor mask ``[B, T, T]`` (a node sees its
  ancestors and itself; siblings share a position, so positions cannot say it), and
  from ``lower_b`` on under a left-padding mask in either case.

A left-padding mask is a per-row lower bound on the key positions
(``causal_mask.KeyLowerBound``), so it keeps each row's visible keys one range and the
kernels stay length-bounded: slots and keys below the bound are never read, so pad
slots may hold anything (NaN included).

Their CPU kernels walk the queries and the keys in blocks (``blocked_attention``,
an online softmax), so a step of ``T`` new tokens over ``S`` slots holds at most one
``QUERY_BLOCK x KEY_BLOCK`` tile of scores per head, never ``T x S`` or ``T x T``:
a long prompt's prefill stays in memory bounded by the blocks, not by its length.

Shapes: ``q [B, Hq, T, D]``; keys and values ``[B, Hkv, S, D]`` with ``Hq = G * Hkv``;
query head ``h`` reads key/value head ``h // G`` (the layout ``repeat_interleave`` and
``enable_gqa`` produce).  ``lse`` is the natural log, fp32, ``[B, Hq, T]``; a query
that sees no key gets ``out = 0`` and ``lse = -inf``, decided by the mask, never by
the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QUERY_BLOCK = 256
KEY_BLOCK = 512
"""Tile of the CPU kernels: fp32 scores of ``G * QUERY_BLOCK x KEY_BLOCK`` per KV head
(with G = 4 query heads per KV head, 2 MiB per KV head and sequence)."""


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
    return out.reshape(B, Hq, T, v_BHSD.shape[-1]), lse.reshape(B, Hq, T)


def blocked_attention(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    allowed: Callable[[slice, slice], torch.Tensor],
    scale: float,
    *,
    key_limit: int | None = None,
    key_start: int = 0,
    query_block: int = QUERY_BLOCK,
    key_block: int = KEY_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_with_lse`` one ``query_block x key_block`` tile at a time.

    ``allowed(queries, keys)`` gives the bool mask ``[B, t, s]`` of one tile.  Each
    tile's partial ``(out, lse)`` comes from ``attention_with_lse`` and is folded into
    the running result by the exact LSE merge, so memory is bounded by the tile while
    the result is the same attention.  ``key_limit`` skips key blocks at or past it
    (slots no query may see, such as those past every sequence's length), and
    ``key_start`` the keys before it (below every sequence's left-padding bound).
    """
    B, Hq, T, _ = q_BHTD.shape
    S = k_BHSD.shape[2] if key_limit is None else min(key_limit, k_BHSD.shape[2])
    out = q_BHTD.new_zeros((B, Hq, T, v_BHSD.shape[-1]), dtype=torch.float32)
    lse = q_BHTD.new_full((B, Hq, T), float("-inf"), dtype=torch.float32)
    for t0 in range(0, T, query_block):
        rows = slice(t0, min(t0 + query_block, T))
        q = q_BHTD[:, :, rows]
        acc, acc_lse = out[:, :, rows], lse[:, :, rows]
        for s0 in range(min(max(key_start, 0), S), S, key_block):
            keys = slice(s0, min(s0 + key_block, S))
            part, part_lse = attention_with_lse(q, k_BHSD[:, :, keys], v_BHSD[:, :, keys], allowed(rows, keys), scale)
            acc, acc_lse = _fold(acc, acc_lse, part, part_lse)
        out[:, :, rows], lse[:, :, rows] = acc, acc_lse
    return out, lse


def _fold(out, lse, part, part_lse):
    """Exact merge of two partials (``lse_merge`` for N = 2, without the stacking)."""
    new_lse = torch.logaddexp(lse, part_lse)
    seen = torch.isfinite(new_lse)
    shift = torch.where(seen, new_lse, 0.0)
    w_old = torch.where(torch.isfinite(lse), torch.exp(lse - shift), 0.0).unsqueeze(-1)
    w_new = torch.where(torch.isfinite(part_lse), torch.exp(part_lse - shift), 0.0).unsqueeze(-1)
    return w_old * out + w_new * part, torch.where(seen, new_lse, float("-inf"))


def prefix_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: torch.Tensor, scale: float,
    kv_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefix_attention`` in plain torch, on any device."""
    slots = torch.arange(k_cache.shape[2], device=k_cache.device)
    key_limit = int(kv_len.max()) if kv_len.numel() else 0
    key_start = int(kv_start.min()) if kv_start is not None and kv_start.numel() else 0

    def allowed(rows: slice, keys: slice) -> torch.Tensor:
        seen = slots[keys][None, :] < kv_len[:, None]
        if kv_start is not None:
            seen = seen & (slots[keys][None, :] >= kv_start[:, None])
        return seen[:, None, :]  # [B, 1, s]

    return blocked_attention(q, k_cache, v_cache, allowed, scale, key_limit=key_limit, key_start=key_start)


@torch.library.custom_op("dcp::prefix_attention", mutates_args=())
def prefix_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: torch.Tensor, scale: float,
    kv_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B,Hq,T,D]`` over cache slots ``[0, kv_len[b])`` of keys
    ``[B,Hkv,S,D]`` and values ``[B,Hkv,S,Dv]`` (``Dv`` may differ from ``D``, as in MLA);
    ``kv_start [B]``: over slots ``[kv_start[b], kv_len[b])`` instead (a left-padding
    mask: the slots before hold pads and are never read)."""
    return prefix_attention_reference(q, k_cache, v_cache, kv_len, scale, kv_start)


@prefix_attention.register_fake
def _prefix_attention_fake(q, k_cache, v_cache, kv_len, scale, kv_start=None):
    B, H, T, _ = q.shape
    return q.new_empty((B, H, T, v_cache.shape[-1]), dtype=torch.float32), q.new_empty((B, H, T), dtype=torch.float32)


def check_ancestors(ancestors: torch.Tensor | None, q: torch.Tensor, op: str = "window_attention") -> None:
    """An ancestor mask, where given, is a bool tensor ``[B, T, T]`` on ``q``'s device
    (``q [B, Hq, T, D]``): the kernels read it as one byte per (query, key)."""
    if ancestors is None:
        return
    B, T = q.shape[0], q.shape[2]
    if ancestors.dtype != torch.bool or tuple(ancestors.shape) != (B, T, T):
        raise ValueError(
            f"{op}: ancestors must be a bool tensor [B, T, T] = [{B}, {T}, {T}] (ancestors[b, t, s]: new token t "
            f"may see new token s, its ancestors and itself), got {ancestors.dtype} {tuple(ancestors.shape)}; "
            f"build it with one row per query token and compare it to 0 (or .bool()) if it holds integers"
        )
    if ancestors.device != q.device:
        raise ValueError(
            f"{op}: q and ancestors must be on one device, got {q.device} and {ancestors.device}; "
            f"move ancestors with .to(q.device)"
        )


def window_attention_reference(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor, scale: float,
    lower: torch.Tensor | None = None, ancestors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``window_attention`` in plain torch, on any device."""
    check_ancestors(ancestors, q)

    def allowed(rows: slice, keys: slice) -> torch.Tensor:
        if ancestors is None:
            seen = positions[:, None, keys] <= positions[:, rows, None]  # [B, t, s]
        else:
            seen = ancestors[:, rows, keys]
        if lower is not None:
            seen = seen & (positions[:, None, keys] >= lower[:, None, None])
        return seen

    return blocked_attention(q, k_new, v_new, allowed, scale)


@torch.library.custom_op("dcp::window_attention", mutates_args=())
def window_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor, scale: float,
    lower: torch.Tensor | None = None, ancestors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the ``T`` new queries over the ``T`` new keys, causal by global
    position: query ``t`` sees key ``s`` where ``positions[b, s] <= positions[b, t]``;
    ``lower [B]``: and ``positions[b, s] >= lower[b]`` (a left-padding mask).

    ``ancestors [B, T, T]`` (bool; a tree verify): query ``t`` sees key ``s`` where
    ``ancestors[b, t, s]`` instead of by position (siblings share one), still only from
    ``lower[b]`` on where a bound is given.  ``positions`` are then read for ``lower``
    alone (they went into RoPE upstream).  A key no query may see may hold anything;
    a key some query sees is a real token, and its values must be finite."""
    return window_attention_reference(q, k_new, v_new, positions, scale, lower, ancestors)


@window_attention.register_fake
def _window_attention_fake(q, k_new, v_new, positions, scale, lower=None, ancestors=None):
    check_ancestors(ancestors, q)
    B, H, T, _ = q.shape
    return q.new_empty((B, H, T, v_new.shape[-1]), dtype=torch.float32), q.new_empty((B, H, T), dtype=torch.float32)


def latent_keys(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """MLA's keys: ``[B, 1, S, C]`` and ``[B, 1, S, R]`` -> ``[B, 1, S, C + R]``."""
    return torch.cat([latent, rope.to(latent.dtype)], dim=-1)


def latent_prefix_attention_reference(
    q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, kv_len: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``latent_prefix_attention`` in plain torch: the keys ``[latent | rope]`` side by side."""
    return prefix_attention_reference(q, latent_keys(latent, rope), latent, kv_len, scale)


@torch.library.custom_op("dcp::latent_prefix_attention", mutates_args=())
def latent_prefix_attention(
    q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, kv_len: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's prefix: ``q [B, H, T, C + R]`` over cache slots ``[0, kv_len[b])`` of one
    latent head ``[B, 1, S, C]`` and its rope key ``[B, 1, S, R]``, the latent as values:
    ``prefix_attention`` with keys ``[latent | rope]``, without building them."""
    return latent_prefix_attention_reference(q, latent, rope, kv_len, scale)


def _latent_fake(q, latent, rope, lengths_or_positions, scale):
    """Both latent ops' outputs: ``(out fp32 [B, H, T, C], lse fp32 [B, H, T])``."""
    B, H, T, _ = q.shape
    return q.new_empty((B, H, T, latent.shape[-1]), dtype=torch.float32), q.new_empty((B, H, T), dtype=torch.float32)


latent_prefix_attention.register_fake(_latent_fake)


def latent_window_attention_reference(
    q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``latent_window_attention`` in plain torch: the keys ``[latent | rope]`` side by side."""
    return window_attention_reference(q, latent_keys(latent, rope), latent, positions, scale)


@torch.library.custom_op("dcp::latent_window_attention", mutates_args=())
def latent_window_attention(
    q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's window: ``q [B, H, T, C + R]`` over the ``T`` new tokens' latent ``[B, 1, T, C]``
    and rope key ``[B, 1, T, R]``, the latent as values, causal by global position:
    ``window_attention`` with keys ``[latent | rope]``, without building them."""
    return latent_window_attention_reference(q, latent, rope, positions, scale)


latent_window_attention.register_fake(_latent_fake)

