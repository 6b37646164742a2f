"""The engine's side of a paged target: each admitted request holds the pages it may fill.

A request is admitted when the pool has the pages for its prompt, its new tokens and the
verify window (``RequestLimits.check``'s need), so a running request never waits for a
page and nothing is ever preempted; requests that do not fit now wait in the queue, in
order.  Pages go back to the pool when the request ends.  Every rank makes the same calls
in the same order (the engine's plan), so every rank holds the same block table, which is
copied into the compiled graphs' table after each change.
"""

from __future__ import annotations

from collections.abc import Sequence

from dcp_compile.runtime.block_tables import BlockTables
from dcp_compile.runtime.paging import Paging
from dcp_compile.runtime.pool import PagePool
from dcp_compile.runtime.request import kv_need


def need_tokens(request, k: int) -> int:
    """KV positions ``request`` may fill (``RequestLimits.check``'s need)."""
    return kv_need(len(request.prompt), request.params.max_new_tokens, k)


class RowPages:
    def __init__(self, paging: Paging, max_batch: int, max_seq_len: int):
        self.paging = paging
        self.blocks = BlockTables(PagePool(paging.shape), max_batch, max_seq_len)
        if self.blocks.table.shape != paging.table.shape:
            raise ValueError(f"the engine's block table {tuple(self.blocks.table.shape)} does not match the compiled "
                             f"graphs' {tuple(paging.table.shape)}; use one max_batch and max_seq_len for both")

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

    def admit(self, row: int, prompt: Sequence[int], tokens: int) -> None:
        """Give ``row`` the pages of ``tokens`` positions; the plan checked that they are free."""
        if self.blocks.admit(row, prompt, tokens) is None:
            raise RuntimeError(f"row {row} was planned {self.pages_for(tokens)} pages but the pool has "
                               f"{self.available}: the ranks' plans and pools disagree")
        self._publish_table()

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
