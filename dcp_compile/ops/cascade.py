"""The functions the passes insert into a target graph: they run at every step.

``passes/`` decides where they go; this module is what they compute, in plain torch
(Inductor compiles them with the rest of the graph):

- from the tensors a KV write stores, the new tokens' keys, values and positions in the
  canonical ``[B, H, T, D]`` / ``[B, T]`` forms (``window_kv``, ``window_positions``) and
  a cache as ``[B, H, S, D]`` (``cache_BHSD``);
- where this rank stores a position (``local_slots``), where a verify step parks its
  tokens (``staging_slots``), how many local slots lie before a step (``prefix_lengths``);
- with a key-padding mask (``MaskProof.key_masks``), which keys each new token may see:
  in this rank's prefix (``prefix_allowed``) and among the new tokens (``window_allowed``);
- with a left-padding bound (``MaskProof.key_lower_bounds``), each row's lowest visible
  position (``key_lower_bound``) and the first local slot at or past it
  (``prefix_starts``), which the length-bounded attention ops take;
- the collective's payload and the exact merge of the ranks' partials with the window
  (``pack_partial``, ``merge_gathered``; ``split_heads``, ``merge_exchanged`` and
  ``join_heads`` for the all-to-all form; under TP, ``join_heads`` of the peers' queries,
  then ``own_heads_of_gathered`` or the all-to-all, and ``merge_own_heads``).
"""

from __future__ import annotations

import torch

from dcp_compile.layout import KVLayout
from dcp_compile.ops.merge import merge_with_window


def _tagged_as(x: torch.Tensor, shape, tags, order: str, batch: int) -> torch.Tensor:
    """Broadcast ``x`` to ``shape``, drop unit axes and permute the tagged axes into ``order``."""
    x = x.expand(shape)
    keep = [i for i, t in enumerate(tags) if t != "1"]
    x = x.reshape([shape[i] for i in keep])
    kept = [tags[i] for i in keep]
    if "H" in order and "H" not in kept:  # a cache with no head axis (MLA's latent): one head
        x = x.unsqueeze(-1)
        kept.append("H")
    if "T" not in kept:
        x = x.unsqueeze(-1)
        kept.append("T")
    if "B" not in kept:
        x = x.expand(batch, *x.shape)
        kept.insert(0, "B")
    return x.permute([kept.index(t) for t in order])


def window_positions(positions: torch.Tensor, *, shape, tags, batch: int) -> torch.Tensor:
    """Global positions of the new tokens, ``[B, T]``."""
    return _tagged_as(positions, shape, tags, "BT", batch)


def window_kv(value: torch.Tensor, *, shape, tags, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """The new tokens' keys or values as the cache stores them, ``[B, H, T, D]``."""
    return _tagged_as(value.to(dtype), shape, tags, "BHTD", batch)


def cache_BHSD(cache: torch.Tensor, *, seq_dim: int) -> torch.Tensor:
    """View a cache buffer as ``[B, H, S, D]``; a ``[B, S, D]`` cache (MLA's latent and
    rope key) as one head."""
    if cache.dim() == 3:
        return cache.unsqueeze(1)
    return cache if seq_dim == 2 else cache.transpose(1, 2)


def BHSD_as_cache(x_BHSD: torch.Tensor, *, seq_dim: int, ndim: int) -> torch.Tensor:
    """``cache_BHSD``'s inverse: ``[B, H, T, D]`` laid out as a cache of ``ndim`` axes
    with its sequence axis at ``seq_dim`` (the new tokens as the cache would hold them)."""
    if ndim == 3:
        return x_BHSD.squeeze(1)
    return x_BHSD if seq_dim == 2 else x_BHSD.transpose(1, 2)


def latent_query(q_latent: torch.Tensor, q_rope: torch.Tensor, *, perm: tuple[int, ...]) -> torch.Tensor:
    """MLA's two query parts as one ``[B, H, T, C + R]`` query (``perm`` brings the
    user's axis order to ``[B, H, T, .]``): ``q_lat . c + q_pe . k_pe`` is one dot product
    with the latent and rope key side by side."""
    return torch.cat([q_latent, q_rope.to(q_latent.dtype)], dim=-1).permute(perm)



def local_slots(positions: torch.Tensor, *, size: int, rank: int, interleave: int, max_seq_len: int) -> torch.Tensor:
    """Where this rank stores each global position: its owner slot, or the trash slot.

    Positions outside ``[0, max_seq_len)`` also go to the trash slot, so a bad position
    can never land in another token's slot (the backend reports it before the call).
    """
    layout = KVLayout(size, rank, max_seq_len, interleave)
    mine = (layout.owner(positions) == rank) & (positions >= 0) & (positions < max_seq_len)
    return torch.where(mine, layout.local_slot(positions), layout.trash_slot)


def staging_slots(positions: torch.Tensor, *, shape, tags, first_slot: int) -> torch.Tensor:
    """Slots a verify graph parks its new tokens in: the ``t``-th new token of every
    sequence goes to ``first_slot + t``, whoever owns its position.  A commit later moves
    the accepted ones to their owner slots, so rejected (or tree) tokens never land in a
    slot that attention reads."""
    slots = torch.full(shape, first_slot, dtype=positions.dtype, device=positions.device)
    if "T" in tags:
        axis = tags.index("T")
        steps = torch.arange(shape[axis], dtype=positions.dtype, device=positions.device)
        slots = slots + steps.view([shape[axis] if i == axis else 1 for i in range(len(shape))])
    return slots


def prefix_lengths(
    positions_BT: torch.Tensor, *, size: int, rank: int, interleave: int, max_seq_len: int
) -> torch.Tensor:
    """Local slots holding global positions before each sequence's first new token, ``[B]``."""
    start = positions_BT.amin(dim=1)
    return KVLayout(size, rank, max_seq_len, interleave).local_length(start)


def key_lower_bound(
    positions_BT: torch.Tensor, *inputs: torch.Tensor, coefs: tuple[int, ...], const: int
) -> torch.Tensor:
    """``[B]`` int64: ``sum(coef * input) + const`` per row, the lowest key position row
    ``b`` may see (``causal_mask.KeyLowerBound``; each input ``[B]`` or one value, in
    any unit-padded shape; the new tokens' positions give the batch and the device)."""
    bound = torch.full((positions_BT.shape[0],), const, dtype=torch.long, device=positions_BT.device)
    for x, coef in zip(inputs, coefs):
        bound = bound + coef * x.reshape(-1).to(torch.long)
    return bound


def prefix_starts(lower: torch.Tensor, *, size: int, rank: int, interleave: int, max_seq_len: int) -> torch.Tensor:
    """``[B]``: local slots holding positions below ``lower`` (the first one a row may
    see: global positions grow with the local slot, so the visible slots are one range)."""
    return KVLayout(size, rank, max_seq_len, interleave).local_length(lower.clamp(0, max_seq_len))


def key_visible(mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``mask [B, W]`` read at ``positions [B, K]``: bool, True where the entry is nonzero;
    False at positions outside ``[0, W)`` (what right-padding the mask with zeros gives)."""
    width = mask.shape[1]
    inside = (positions >= 0) & (positions < width)
    return (mask.gather(1, positions.clamp(0, width - 1)) != 0) & inside


def prefix_allowed(
    positions_BT: torch.Tensor, kv_len: torch.Tensor, *key_masks: torch.Tensor, slots: int, size: int, rank: int,
    interleave: int, max_seq_len: int, lower: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, 1, slots]``: local slot ``j`` is visible to every new token of sequence ``b``
    when it lies before the sequence's first new token (``j < kv_len[b]``), every key
    mask holds at the global position it stores, and that position is at least
    ``lower[b]`` where a left-padding bound is given."""
    layout = KVLayout(size, rank, max_seq_len, interleave)
    slot = torch.arange(slots, device=positions_BT.device)
    allowed = slot[None, :] < kv_len[:, None]
    held = layout.global_position(slot).expand(positions_BT.shape[0], slots)
    for mask in key_masks:
        allowed = allowed & key_visible(mask, held)
    if lower is not None:
        allowed = allowed & (held >= lower[:, None])
    return allowed[:, None, :]


def window_allowed(
    positions_BT: torch.Tensor, *key_masks: torch.Tensor, lower: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, T, T]``: new token ``t`` sees new token ``u`` when ``pos[u] <= pos[t]``, every
    key mask holds at ``pos[u]``, and ``pos[u] >= lower[b]`` where a bound is given."""
    allowed = positions_BT[:, None, :] <= positions_BT[:, :, None]
    for mask in key_masks:
        allowed = allowed & key_visible(mask, positions_BT)[:, None, :]
    if lower is not None:
        allowed = allowed & (positions_BT >= lower[:, None])[:, None, :]
    return allowed


def pack_partial(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``[B,H,T,D]`` fp32 and ``[B,H,T]`` fp32 -> ``[B,H,T,D+1]``: one payload, one collective."""
    return torch.cat([out, lse.unsqueeze(-1)], dim=-1)


def merge_gathered(
    gathered: torch.Tensor, window_out: torch.Tensor, window_lse: torch.Tensor, *, size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Merge the ``size`` gathered prefixes (rank order) and the window; cast to ``dtype``."""
    partials = gathered.view(size, *window_out.shape[:-1], window_out.shape[-1] + 1)
    return merge_with_window(partials[..., :-1], partials[..., -1], window_out, window_lse).to(dtype)


def split_heads(packed: torch.Tensor, *, size: int) -> torch.Tensor:
    """``[B, H, T, D+1]`` -> ``[size, B, H/size, T, D+1]``: row ``j`` is what rank ``j`` merges."""
    B, H, T, W = packed.shape
    return packed.view(B, size, H // size, T, W).movedim(1, 0).contiguous()


def merge_exchanged(
    exchanged: torch.Tensor, window_out: torch.Tensor, window_lse: torch.Tensor, *, size: int, rank: int, dtype: torch.dtype
) -> torch.Tensor:
    """Merge this rank's heads: every rank's prefix (rank order) and the window; ``[B, H/size, T, D]``."""
    heads = window_out.shape[1] // size
    own = slice(rank * heads, (rank + 1) * heads)
    out = merge_with_window(exchanged[..., :-1], exchanged[..., -1], window_out[:, own], window_lse[:, own])
    return out.to(dtype).contiguous()


def own_heads_of_gathered(gathered: torch.Tensor, *, size: int, rank: int) -> torch.Tensor:
    """``[size * B, size * H, T, D+1]`` (every peer's partials over its shard, for every
    peer's heads) -> ``[size, B, H, T, D+1]``: this rank's head block from each peer."""
    _, heads, T, W = gathered.shape
    return gathered.view(size, -1, size, heads // size, T, W)[:, :, rank]


def merge_own_heads(
    partials: torch.Tensor, window_out: torch.Tensor, window_lse: torch.Tensor, *, dtype: torch.dtype
) -> torch.Tensor:
    """Under TP, where the window holds this rank's heads alone: merge every peer's prefix
    of those heads (``[size, B, H, T, D+1]``, rank order) with the window; ``[B, H, T, D]``."""
    return merge_with_window(partials[..., :-1], partials[..., -1], window_out, window_lse).to(dtype)


def join_heads(gathered: torch.Tensor, *, size: int) -> torch.Tensor:
    """``[size * B, H/size, T, D]`` (rank-major) -> ``[B, H, T, D]``."""
    _, heads, T, D = gathered.shape
    return gathered.view(size, -1, heads, T, D).movedim(0, 1).reshape(-1, size * heads, T, D)
