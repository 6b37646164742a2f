"""What ``prepare`` decided about each KV cache buffer, looked up by the backend.

The backend receives only the traced graph and its real inputs, so ``prepare`` records
each cache tensor here (weakly, by identity).  Records are written once, at prepare
time, and only read at compile time: nothing here is consulted or changed while a
compiled graph runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dcp_compile.layout import KVLayout

ROLES = ("target", "draft")


@dataclass(frozen=True)
class CacheRecord:
    """One KV cache buffer as ``prepare`` left it."""

    name: str
    """Module path of the buffer, e.g. ``layers.0.attn.k_cache``."""
    role: str
    """``"target"`` (sharded when the group has more than one rank) or ``"draft"`` (whole)."""
    seq_dim: int
    """Axis that holds token positions."""
    layout: KVLayout
    """The layout the buffer is stored in; size 1 for whole (draft or off-arm) caches."""
    global_shape: tuple[int, ...]
    """Shape of the buffer before prepare."""
    verify_tokens: int = 0
    """Staging slots after the trash slot, where verify graphs park new tokens until a
    commit (sharded targets only)."""
    tree_slots: int = 0
    """Slots after a whole draft cache's ``max_seq_len``, where a tree draft's depths keep
    their nodes for the later depths to attend to (drafts only)."""
    page_size: int = 0
    """Slots a page holds, for a cache ``prepare`` paged (``paged_for`` gives its pages); 0: not paged."""

    @property
    def sharded(self) -> bool:
        """Laid out as a shard (owner slots, the trash slot, staging): every target of a
        group of more than one, and a tree or paged target of a group of one."""
        return self.layout.size > 1 or self.verify_tokens > 0 or self.page_size > 0


_records: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(tensor: torch.Tensor, record: CacheRecord) -> None:
    _records[tensor] = record


def record_for(tensor: torch.Tensor) -> CacheRecord | None:
    return _records.get(tensor)


_tables: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_table(tensor: torch.Tensor, name: str) -> None:
    """``tensor`` is this rank's columns of a causal-mask table that ``prepare`` checked
    lower triangular."""
    _tables[tensor] = name


def is_checked_table(tensor: torch.Tensor) -> bool:
    return tensor in _tables


@dataclass(eq=False)
class PagedKV:
    """Where a paged cache's keys or values really live (``prepare(page_size=...)``).

    The model keeps a buffer of its local shape for tracing, but with no memory of its own
    along the sequence axis; the compiled graphs read and write these instead."""

    pool: torch.Tensor
    """``[pages + 1, H, P, D]`` (``H`` = 1 for MLA's ``[B, S, C]`` caches): the owner slots of
    every row, page by page; the last page is the null page, where writes of unheld slots
    land and which nothing reads."""
    rows: torch.Tensor
    """The cache's own layout with ``1 + verify_tokens`` slots: each row's trash slot and
    staging slots (the local slots from ``S_loc`` on)."""
    table: torch.Tensor
    """``[B, pages a row]`` int32, shared by the model's caches: row ``b``'s local slot
    ``s`` is in page ``table[b, s // P]`` at row ``s % P``."""
    rows_capacity: int
    """``S_loc``: the owner slots a row may hold; local slot ``S_loc + j`` is ``rows[:, :, j]``."""


_paged: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_paged(tensor: torch.Tensor, paged: PagedKV) -> None:
    _paged[tensor] = paged


def paged_for(tensor: torch.Tensor) -> PagedKV | None:
    """The pages behind a cache buffer ``prepare`` paged, else ``None``."""
    return _paged.get(tensor)
