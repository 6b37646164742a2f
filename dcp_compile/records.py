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

    @property
    def sharded(self) -> bool:
        """Laid out as a shard (owner slots, the trash slot, staging): every target of a
        group of more than one, and a tree target (``prepare(tree=True)``) of a group of one."""
        return self.layout.size > 1 or self.verify_tokens > 0


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
