"""The engine's side of a paged target: each admitted request holds the pages it may fill,
and the pages of the prompts before it are reused.

A request is admitted when the pool has the pages for its prompt, its new tokens and the
verify window (``RequestLimits.check``'s need), so a running request never waits for a
page; requests that do not fit now wait in the queue, in order.  With preemption
(``SpecEngine(preemption=True)``) a request is admitted by the pages of its prompt and its
next steps (``reserve_tokens``), its row grows a page at a time, and when the pool runs out
the newest request is preempted and computed again later.  Pages go back to the pool when
the request ends.  Every rank makes the same calls
in the same order (the engine's plan), so every rank holds the same block table, which is
copied into the compiled graphs' table after each change.

Prefix caching.  Once a prompt is prefilled, its whole pages are indexed (``PagePool``'s
hash chain); a later prompt that starts with the same tokens takes those pages and its
prefill starts after them.  A hit computes what a miss would, bit for bit:

- it is cut to whole prefill chunks (``granularity``), so that every chunk the request
  does compute starts where a miss's would, and attends over the same slots in the same
  pieces;
- a page's key covers the token after it, which the draft's keys at the page's last
  position read;
- the draft's cache stays whole, in rows: its keys and values of the indexed pages are
  copied into a store beside the pool (one entry per pool page, ``P x D`` positions) and
  back into a hit's row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dcp_compile.records import record_for
from dcp_compile.runtime.block_tables import BlockTables
from dcp_compile.runtime.paging import Paging
from dcp_compile.runtime.pool import PagePool
from dcp_compile.runtime.request import kv_need


def need_tokens(request, k: int) -> int:
    """KV positions ``request`` may fill (``RequestLimits.check``'s need)."""
    return kv_need(len(request.prompt), request.params.max_new_tokens, k)


def reserve_tokens(request, k: int, grow: bool) -> int:
    """KV positions ``request``'s pages must cover: all it may fill, or, for rows that
    ``grow``, those it holds and what the step in flight and the next may commit."""
    need = need_tokens(request, k)
    return need if not grow else min(need, len(request.prompt) + len(request.tokens) + 2 * (k + 1))


def draft_caches(draft) -> list[tuple[torch.Tensor, int]]:
    """A prepared draft's KV caches and their sequence axes."""
    if draft is None:
        return []
    records = ((buffer, record_for(buffer)) for buffer in draft.buffers())
    return [(buffer, record.seq_dim) for buffer, record in records if record is not None and record.role == "draft"]


def draft_token_bytes(draft) -> int:
    """Bytes of one position of every cache of a prepared draft: what ``DraftPages`` keeps
    per pool token."""
    return sum(cache.numel() // (cache.shape[0] * cache.shape[seq_dim]) * cache.element_size()
               for cache, seq_dim in draft_caches(draft))


class DraftPages:
    """The draft's keys and values of each indexed pool page, kept for the requests that reuse it."""

    def __init__(self, caches: list[tuple[torch.Tensor, int]], pages: int, page_tokens: int):
        self.caches, self.page_tokens = caches, page_tokens
        self.stores = [torch.empty((pages, page_tokens, *self._seq_first(cache, seq_dim, 0).shape[1:]),
                                   dtype=cache.dtype, device=cache.device) for cache, seq_dim in caches]

    @staticmethod
    def _seq_first(cache: torch.Tensor, seq_dim: int, row: int) -> torch.Tensor:
        return cache[row].movedim(seq_dim - 1, 0)

    def keep(self, row: int, logical: Sequence[int], pages: Sequence[int]) -> None:
        """Copy ``row``'s logical pages ``logical`` into the store's entries ``pages``."""
        if not logical or not self.stores:
            return
        span = (max(logical) + 1) * self.page_tokens
        source = torch.tensor(list(logical), device=self.stores[0].device)
        target = torch.tensor(list(pages), device=source.device)
        for (cache, seq_dim), store in zip(self.caches, self.stores):
            by_page = self._seq_first(cache, seq_dim, row)[:span].unflatten(0, (-1, self.page_tokens))
            store[target] = by_page[source]

    def restore(self, row: int, pages: Sequence[int]) -> None:
        """Write the store's entries ``pages`` into ``row``'s first positions."""
        if not pages or not self.stores:
            return
        index = torch.tensor(list(pages), device=self.stores[0].device)
        for (cache, seq_dim), store in zip(self.caches, self.stores):
            self._seq_first(cache, seq_dim, row)[: len(pages) * self.page_tokens] = store[index].flatten(0, 1)


class RowPages:
    """``prefix_caching``: reuse the pages of earlier prompts (``chunk_size``: the prefill's
    chunks, which a hit must keep; ``draft``: the prepared draft, whose cache a hit gets too)."""

    def __init__(self, paging: Paging, max_batch: int, max_seq_len: int, *, chunk_size: int,
                 prefix_caching: bool = False, draft=None):
        self.paging = paging
        self.blocks = BlockTables(PagePool(paging.shape), max_batch, max_seq_len)
        if self.blocks.table.shape != paging.table.shape:
            raise ValueError(f"the engine's block table {tuple(self.blocks.table.shape)} does not match the compiled "
                             f"graphs' {tuple(paging.table.shape)}; use one max_batch and max_seq_len for both")
        page_tokens = paging.shape.page_tokens
        self.prefix_caching = prefix_caching
        self.granularity = math.lcm(page_tokens, chunk_size) // page_tokens
        """Pages a hit is a multiple of: whole prefill chunks."""
        self.draft_pages = DraftPages(draft_caches(draft), paging.shape.pages, page_tokens) if prefix_caching else None

    @property
    def capacity_tokens(self) -> int:
        return self.paging.shape.pages * self.paging.shape.page_tokens

    @property
    def used_tokens(self) -> int:
        return self.blocks.pool.used * self.paging.shape.page_tokens

    def pages_for(self, tokens: int) -> int:
        return self.paging.shape.pages_for(tokens)

    @property
    def available(self) -> int:
        return self.blocks.pool.available

    def admit(self, row: int, prompt: Sequence[int], tokens: int) -> int:
        """Give ``row`` the pages of ``tokens`` positions (the plan checked that they are free);
        returns the leading prompt tokens cached pages already hold."""
        admitted = self.blocks.admit(row, prompt if self.prefix_caching else (), tokens, self.granularity)
        if admitted is None:
            raise RuntimeError(f"row {row} was planned {self.pages_for(tokens)} pages but the pool has "
                               f"{self.available}: the ranks' plans and pools disagree")
        if admitted.cached_tokens:
            cached_pages = admitted.cached_tokens // self.paging.shape.page_tokens
            self.draft_pages.restore(row, self.blocks.pages_of(row)[:cached_pages])
        self._publish_table()
        return admitted.cached_tokens

    def prefilled(self, row: int, prompt: Sequence[int]) -> None:
        """``row`` holds ``prompt``'s keys and values now: index its whole pages."""
        if not self.prefix_caching:
            return
        indexed = self.blocks.publish(row, prompt)
        pages = self.blocks.pages_of(row)
        self.draft_pages.keep(row, indexed, [pages[i] for i in indexed])

    def grow(self, row: int, tokens: int) -> bool:
        """Pages for ``row``'s first ``tokens`` positions; ``False``, with nothing taken, if the
        pool lacks them."""
        held = len(self.blocks.pages_of(row))
        if not self.blocks.grow(row, tokens):
            return False
        if len(self.blocks.pages_of(row)) != held:
            self._publish_table()
        return True

    def admitted_at(self, row: int) -> int:
        return self.blocks.admitted_at(row)

    def newest(self, rows: Sequence[int]) -> int:
        return self.blocks.newest(rows)

    def release(self, row: int) -> None:
        self.blocks.release(row)
        self._publish_table()

    def _publish_table(self) -> None:
        """The host's table into the graphs' one, queued behind the step in flight: a copy from
        pageable memory would first wait for the stream, and so for that step."""
        if self.paging.table.is_cuda:
            self.paging.table.copy_(self.blocks.table.pin_memory(), non_blocking=True)
        else:
            self.paging.table.copy_(self.blocks.table)
