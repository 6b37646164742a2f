"""``prepare(page_size=P, kv_tokens=N)``: a target's caches in pages of a pool.

The model keeps a buffer of its local shape, so that Dynamo traces it as before, but the
buffer is an expanded view with no memory along the sequence axis.  What it stands for
lives in a ``records.PagedKV``: the owner slots in a pool of pages ``[pages + 1, H, P,
D]`` (the last page the null page), the trash and staging slots in a small per-row
buffer, and one block table for all of the model's caches.  The backend's
``page_caches`` pass points the graphs at those.

``N`` is the group's capacity in tokens, so each rank's pool holds ``N / D`` of them; a
logical page spans ``P x D`` token positions and the block table is the same on every
rank (``runtime.block_tables``).  Without ``kv_tokens`` on a CUDA device, ``N`` is sized
from the memory the device has left (``pool_tokens_from_memory``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcp_compile.group import DCPGroup, gather_from_ranks
from dcp_compile.layout import KVLayout
from dcp_compile.memory import BASE_RESERVE_BYTES, CapacityError, GiB
from dcp_compile.records import PagedKV
from dcp_compile.runtime.pool import PoolShape


@dataclass(frozen=True)
class Paging:
    """One model's pool: its shape and the block table its caches share."""

    shape: PoolShape
    table: torch.Tensor
    """``[max_batch, pages a row]`` int32, every entry the null page until the caller
    (``BlockTables``) names a row's pages."""

    @property
    def page_size(self) -> int:
        return self.shape.page_size


def plan_paging(page_size: int, kv_tokens: int, layout: KVLayout, max_batch: int, device) -> Paging:
    """Refuse a page size or capacity that cannot work for ``layout``, else the pool's
    shape and a block table of null pages."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int (slots a page holds on each rank), got {page_size!r}")
    if page_size % layout.interleave:
        raise ValueError(
            f"page_size={page_size} does not divide into the layout's blocks of interleave={layout.interleave} "
            f"positions: a logical page must hold whole blocks of every rank. Use a multiple of {layout.interleave}")
    shape = PoolShape(page_size, layout.size, kv_tokens)
    row_pages = -(-layout.local_capacity // page_size)
    table = torch.full((max_batch, row_pages), shape.pages, dtype=torch.int32, device=device)
    return Paging(shape, table)


def paged_shapes(shape: list[int], seq_dim: int, paging: Paging, capacity: int, name: str) -> tuple[list, list]:
    """``(pool, rows)`` shapes for one cache of local ``shape``: a ``[B, H, S, D]`` cache's
    pool is ``[pages + 1, H, P, D]``, an MLA ``[B, S, C]`` one's ``[pages + 1, 1, P, C]``
    (the latent kernels' one head); its rows keep the slots from ``capacity`` on."""
    if (len(shape), seq_dim) not in ((4, 2), (3, 1)):
        raise ValueError(
            f"KV cache {name} has shape {tuple(shape)} with its sequence on axis {seq_dim}; page_size pages "
            f"[batch, heads, seq, head_dim] caches (sequence on axis 2) and MLA's [batch, seq, width] ones. "
            f"Prepare this model without page_size")
    heads = shape[1] if len(shape) == 4 else 1
    rows = list(shape)
    rows[seq_dim] = shape[seq_dim] - capacity
    return [paging.shape.pages + 1, heads, paging.page_size, shape[-1]], rows


def paged_buffers(shape: list[int], seq_dim: int, dtype: torch.dtype, device, paging: Paging, capacity: int,
                  name: str) -> tuple[torch.Tensor, PagedKV]:
    """The stand-in buffer of local ``shape`` and the pages behind it, for one cache."""
    pool_shape, rows_shape = paged_shapes(shape, seq_dim, paging, capacity, name)
    unit = list(shape)
    unit[seq_dim] = 1
    stand_in = torch.zeros(unit, dtype=dtype, device=device).expand(shape)
    pool = torch.zeros(pool_shape, dtype=dtype, device=device)
    rows = torch.zeros(rows_shape, dtype=dtype, device=device)
    return stand_in, PagedKV(pool, rows, paging.table, capacity)


def paged_bytes(paged: PagedKV) -> int:
    return sum(t.numel() * t.element_size() for t in (paged.pool, paged.rows))


@dataclass(frozen=True)
class PoolBudget:
    """What sizes a pool from a device's memory: ``fraction`` of its total may be in use
    once the pool is there, with ``reserve_bytes`` of it kept for the steps' activations;
    ``token_bytes``: what each of the pool's tokens costs every rank beyond the target's
    pages (the draft's keys and values of an indexed page, kept whole on every rank for
    prefix hits: ``row_pages.DraftPages``)."""

    fraction: float = 0.9
    reserve_bytes: int = BASE_RESERVE_BYTES
    token_bytes: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"the memory fraction must be in (0, 1], got {self.fraction}")
        if self.reserve_bytes < 0 or self.token_bytes < 0:
            raise ValueError(f"reserve_bytes and token_bytes must be >= 0, got {self.reserve_bytes} and "
                             f"{self.token_bytes}")


def pool_tokens_from_memory(slot_bytes: int, row_bytes: int, page_size: int, layout: KVLayout, group: DCPGroup,
                            device: torch.device, budget: PoolBudget) -> int:
    """The largest pool, in tokens over the group, whose pages (and ``budget.token_bytes`` a
    token) fit ``budget.fraction`` of the device beside what it holds now (the weights, the
    draft and its cache), the reserve and every row's own slots (``row_bytes``);
    ``slot_bytes``: one slot of every cache of the model.  The smallest over the model's
    ranks, so that all hold the same pages."""
    if device.type != "cuda":
        raise ValueError(
            f"page_size without kv_tokens sizes the pool from a CUDA device's free memory; the model is on {device}. "
            f"Give kv_tokens= (the pool's tokens over the DCP group)")
    torch.cuda.empty_cache()  # blocks the allocator keeps but nothing holds are room for pages
    free, total = torch.cuda.mem_get_info(device)
    room = int(total * budget.fraction) - (total - free) - budget.reserve_bytes - row_bytes
    # A rank's slot holds one of the group's D tokens, and each token costs every rank token_bytes.
    slots = max(room, 0) // (slot_bytes + layout.size * budget.token_bytes) // page_size * page_size
    slots = min(int(t.item()) for t in gather_from_ranks(group, torch.tensor([slots], device=device)))
    tokens = slots * layout.size
    if tokens < layout.max_seq_len:
        raise CapacityError(
            f"the KV pool would hold {tokens:,} tokens, less than one request of max_seq_len={layout.max_seq_len:,}: "
            f"{budget.fraction:.2f} of {total / GiB:.1f} GiB, less the {(total - free) / GiB:.1f} GiB in use, the "
            f"{budget.reserve_bytes / GiB:.1f} GiB reserve and {row_bytes / GiB:.2f} GiB of row slots, leaves "
            f"{max(room, 0) / GiB:.2f} GiB at {slot_bytes:,} bytes a slot and {budget.token_bytes:,} a token. Lower "
            f"max_seq_len or max_batch, raise the memory fraction, or shard over more ranks")
    return tokens
