"""Prefix attention over a paged cache: ``dcp::paged_prefix_attention``.

A paged cache is a pool of pages shared by every sequence, ``[pages, Hkv, P, D]`` (each
page holds ``P`` slots of every KV head, each head's slots contiguous), and a block table
``[B, n]`` whose row ``b`` names, in order, the pages that hold sequence ``b``'s slots:
slot ``s`` lives in page ``table[b, s // P]`` at row ``s % P``.  A sequence may use at
most ``n * P`` slots; its ``kv_len`` counts them, and table entries past its last page
are never read.

The op answers what ``dcp::prefix_attention`` answers over the gathered cache
(``gather_pages``): on CPU by gathering and running the reference, on CUDA by the prefix
kernels reading through the table (``triton_paged.py``), bitwise-equal in fp32 to the same
kernel over the gathered cache.  ``dcp::paged_latent_prefix_attention`` is MLA's form:
``latent_prefix_attention`` over latent and rope-key pools."""

from __future__ import annotations

import torch

from dcp_compile.ops.attention import latent_prefix_attention_reference, prefix_attention_reference


def gather_pages(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The ``[B, Hkv, n * P, D]`` cache that ``table [B, n]`` makes of ``pool [pages, Hkv, P, D]``."""
    B, n = table.shape
    _, H, P, D = pool.shape
    pages = pool.index_select(0, table.reshape(-1).long())  # [B * n, H, P, D]
    return pages.view(B, n, H, P, D).transpose(1, 2).reshape(B, H, n * P, D)


def check_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                kv_len: torch.Tensor) -> None:
    """Refuse pools, tables and lengths that do not fit ``q``, saying what was expected."""
    if k_pool.dim() != 4 or v_pool.dim() != 4 or k_pool.shape[:3] != v_pool.shape[:3]:
        raise ValueError(f"paged_prefix_attention expects k_pool [pages, Hkv, P, D] and v_pool [pages, Hkv, P, Dv] "
                         f"of the same pages, heads and page size; got {tuple(k_pool.shape)} and "
                         f"{tuple(v_pool.shape)}")
    if table.dim() != 2 or table.shape[0] != q.shape[0] or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be an int32 or int64 tensor [B, pages a sequence] with B={q.shape[0]}, "
                         f"got {table.dtype} {tuple(table.shape)}")
    if k_pool.shape[0] == 0 or k_pool.shape[2] == 0:
        raise ValueError(f"the pool needs at least one page of at least one slot, got {tuple(k_pool.shape)}")
    if not table.is_contiguous() or table.device != q.device:
        raise ValueError(f"block_table must be contiguous and on q's device ({q.device}); got "
                         f"{table.device}{'' if table.is_contiguous() else ', not contiguous'}: pass "
                         f"table.contiguous().to(q.device)")


def paged_prefix_attention_reference(q, k_pool, v_pool, block_table, kv_len, scale, kv_start=None):
    """``paged_prefix_attention`` in plain torch, on any device."""
    check_paged(q, k_pool, v_pool, block_table, kv_len)
    return prefix_attention_reference(q, gather_pages(k_pool, block_table), gather_pages(v_pool, block_table),
                                      kv_len, scale, kv_start)


@torch.library.custom_op("dcp::paged_prefix_attention", mutates_args=())
def paged_prefix_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor, kv_len: torch.Tensor,
    scale: float, kv_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefix_attention`` of ``q [B, Hq, T, D]`` over slots ``[0, kv_len[b])`` (or
    ``[kv_start[b], kv_len[b])``) of the cache ``block_table`` makes of the pools."""
    return paged_prefix_attention_reference(q, k_pool, v_pool, block_table, kv_len, scale, kv_start)


@paged_prefix_attention.register_fake
def _paged_fake(q, k_pool, v_pool, block_table, kv_len, scale, kv_start=None):
    B, H, T, _ = q.shape
    return q.new_empty((B, H, T, v_pool.shape[-1]), dtype=torch.float32), q.new_empty((B, H, T), dtype=torch.float32)


def paged_latent_prefix_attention_reference(q, latent_pool, rope_pool, block_table, kv_len, scale):
    """``paged_latent_prefix_attention`` in plain torch, on any device."""
    check_paged(q, latent_pool, rope_pool, block_table, kv_len)
    return latent_prefix_attention_reference(q, gather_pages(latent_pool, block_table),
                                             gather_pages(rope_pool, block_table), kv_len, scale)


@torch.library.custom_op("dcp::paged_latent_prefix_attention", mutates_args=())
def paged_latent_prefix_attention(
    q: torch.Tensor, latent_pool: torch.Tensor, rope_pool: torch.Tensor, block_table: torch.Tensor,
    kv_len: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's prefix (``latent_prefix_attention``) over the latent ``[pages, 1, P, C]`` and
    rope-key ``[pages, 1, P, R]`` pools through ``block_table``."""
    return paged_latent_prefix_attention_reference(q, latent_pool, rope_pool, block_table, kv_len, scale)


@paged_latent_prefix_attention.register_fake
def _paged_latent_fake(q, latent_pool, rope_pool, block_table, kv_len, scale):
    B, H, T, _ = q.shape
    return (q.new_empty((B, H, T, latent_pool.shape[-1]), dtype=torch.float32),
            q.new_empty((B, H, T), dtype=torch.float32))


def store_in_pages(pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, *,
                   capacity: int) -> None:
    """Write ``values [B, H, T, D]`` to local slots ``slots [B, T]`` of each row through
    ``table``; slots from ``capacity`` on (the trash slot, or past the end), and slots of
    pages the row does not hold, go to the null page (the pool's last), which nothing reads."""
    page_size, null = pool.shape[2], pool.shape[0] - 1
    slots = slots.long()
    entry = (slots // page_size).clamp(0, table.shape[1] - 1)
    page = table.long().gather(1, entry)
    owned = (slots >= 0) & (slots < capacity) & (page >= 0) & (page < null)
    page = torch.where(owned, page, null)
    pool[page, :, slots.remainder(page_size)] = values.transpose(1, 2).to(pool.dtype)
