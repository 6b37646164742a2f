"""Each running row's pages of a ``PagePool``, kept as the block table the compiled graphs
read, and the rules that admit, grow, preempt and refuse requests by the tokens they hold.

The table is ``[max_batch, pages_per_row]`` int32: row ``b``'s entry ``i`` is the page
that holds its logical page ``i`` (token positions ``[i * P * D, (i + 1) * P * D)``), the
same on every rank of the group.  Entries a row does not hold, and every entry of a free
row, name the null page: one physical page past the pool's, which the pool never hands out,
so a write of a row no request holds lands where no request reads.

Every rank makes the same calls in the same order (as the engine's decisions are made),
so every rank holds the same table.  This module owns no device tensor: the engine copies
``table`` into the captured graphs' static input when it changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dcp_compile.runtime.pool import PagePool


@dataclass(frozen=True)
class Admission:
    """What ``BlockTables.admit`` gave a request."""

    cached_tokens: int
    """Leading prompt tokens whose keys and values cached pages already hold: the prefill
    starts after them."""
    pages: int
    """Pages the row holds now (cached and newly taken)."""


class BlockTables:
    """The pages of every row of one decoder, and its block table."""

    def __init__(self, pool: PagePool, max_batch: int, max_seq_len: int):
        if max_batch < 1 or max_seq_len < 1:
            raise ValueError(f"max_batch and max_seq_len must be positive, got {max_batch} and {max_seq_len}")
        self.pool = pool
        self.pages_per_row = pool.shape.pages_for(max_seq_len)
        self.null_page = pool.shape.pages
        """The page past the pool that unheld entries name: pools are allocated with one more page."""
        self.table = torch.full((max_batch, self.pages_per_row), self.null_page, dtype=torch.int32)
        self._pages: list[list[int]] = [[] for _ in range(max_batch)]
        self._admitted_at: list[int | None] = [None] * max_batch
        self._clock = 0

    @property
    def page_tokens(self) -> int:
        return self.pool.shape.page_tokens

    def refusal(self, tokens: int) -> str | None:
        """Why a request that may hold ``tokens`` positions (its prompt, its new tokens and
        a step's slack) could never run, or ``None`` if it fits an empty pool."""
        need = self.pool.shape.pages_for(tokens)
        if need > self.pool.shape.pages:
            return (f"the request needs {tokens} tokens of KV ({need} pages of {self.page_tokens}), more than the "
                    f"pool's {self.pool.shape.pages * self.page_tokens} ({self.pool.shape.pages} pages): ask for "
                    f"fewer tokens, or give the pool more (--kv-tokens)")
        if need > self.pages_per_row:
            return (f"the request needs {tokens} tokens of KV, more than a row's "
                    f"{self.pages_per_row * self.page_tokens} (max_seq_len): ask for fewer tokens")
        return None

    def admit(self, row: int, prompt: Sequence[int], tokens: int, granularity: int = 1) -> Admission | None:
        """Give free ``row`` the pages for its first ``tokens`` positions (the prompt and the
        next step), reusing the cached pages of ``prompt``'s longest indexed prefix (a
        multiple of ``granularity`` pages); ``None``, with nothing taken, if the pool lacks
        the pages now."""
        if self._pages[row]:
            raise ValueError(f"row {row} still holds {len(self._pages[row])} pages: release it first")
        cached = self.pool.match(prompt, granularity)
        fresh = self.pool.allocate(max(0, self.pool.shape.pages_for(tokens) - len(cached)))
        if fresh is None:
            self.pool.release(cached)
            return None
        self._set(row, cached + fresh)
        self._clock += 1
        self._admitted_at[row] = self._clock
        return Admission(cached_tokens=len(cached) * self.page_tokens, pages=len(cached) + len(fresh))

    def grow(self, row: int, tokens: int) -> bool:
        """Pages for ``row``'s first ``tokens`` positions; ``False``, with nothing taken, if
        the pool lacks them (the caller preempts a row and tries again)."""
        missing = self.pool.shape.pages_for(tokens) - len(self._pages[row])
        if missing <= 0:
            return True
        if len(self._pages[row]) + missing > self.pages_per_row:
            raise ValueError(f"row {row} would hold {tokens} tokens, more than its "
                             f"{self.pages_per_row * self.page_tokens}")
        fresh = self.pool.allocate(missing)
        if fresh is None:
            return False
        self._set(row, self._pages[row] + fresh)
        return True

    def publish(self, row: int, prompt: Sequence[int]) -> list[int]:
        """Index the whole pages of ``prompt``, whose keys and values ``row`` now holds, for
        later requests; returns the row's logical pages that were indexed."""
        return self.pool.publish(prompt, self._pages[row])

    def release(self, row: int) -> None:
        """Free ``row``: its pages go back to the pool (cached ones stay evictable)."""
        self.pool.release(self._pages[row])
        self._set(row, [])
        self._admitted_at[row] = None

    def newest(self, rows: Sequence[int]) -> int:
        """Of ``rows`` (each holding a request), the one admitted last: the one to preempt."""
        held = [r for r in rows if self._admitted_at[r] is not None]
        if not held:
            raise ValueError(f"none of rows {list(rows)} holds a request")
        return max(held, key=lambda r: self._admitted_at[r])

    def admitted_at(self, row: int) -> int:
        """When ``row``'s request was admitted (a count of admissions): older first."""
        if self._admitted_at[row] is None:
            raise ValueError(f"row {row} holds no request")
        return self._admitted_at[row]

    def pages_of(self, row: int) -> list[int]:
        return list(self._pages[row])

    def _set(self, row: int, pages: list[int]) -> None:
        self._pages[row] = pages
        self.table[row] = self.null_page
        if pages:
            self.table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
