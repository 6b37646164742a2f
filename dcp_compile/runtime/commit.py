"""KVCommit: after acceptance, move the accepted tokens' K/V from staging to their owners.

A sharded verify graph (``dcp.backend(group, verify=True)``) stores the ``t``-th new
token of each sequence in staging slot ``S_loc + 1 + t`` of every target cache, so
rejected tokens never reach a slot that attention reads.  Once the runtime knows how
many tokens each sequence accepted, ``KVCommit(start, accepted)`` copies staging slot
``t < accepted[b]`` to the owner slot of position ``start[b] + t`` on the rank that owns
it (the others write to their trash slot).  Static shapes, no data-dependent control
flow: it compiles to one small graph.

A tree verify stages its nodes in tree order, so the accepted path is not a prefix of
the staging slots: ``KVCommit(start, accepted, path)`` takes ``path [B, T]``, the
staging index of the path's ``t``-th token (``runtime.tree.commit_slots``), and moves
staging slot ``path[b, t]`` to the owner of position ``start[b] + t``.

On a group of size 1 the verify graph already wrote in place (plain torch.compile
semantics; later tokens overwrite rejected ones), so the commit does nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from dcp_compile.ops.cascade import cache_BHSD, local_slots
from dcp_compile.ops.paged import store_in_pages
from dcp_compile.records import CacheRecord, paged_for, record_for


class KVCommit(nn.Module):
    """``forward(start [B], accepted [B], path [B, T] | None)``: commit ``accepted[b]``
    tokens from position ``start[b]`` of every sequence, for every staged target cache of
    ``model``; the ``t``-th from staging slot ``t``, or ``path[b, t]`` when given."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self._records: list[CacheRecord] = []
        self._entries: list[tuple[int, bool]] = []
        """Per record: its buffers' index, and whether they are pages."""
        for index, (name, buffer) in enumerate(model.named_buffers()):
            record = record_for(buffer)
            if record is not None and record.role == "target" and record.sharded:
                if record.verify_tokens == 0:
                    raise ValueError(
                        f"KV cache {name} has no staging slots; prepare the target with verify_tokens=k+1 "
                        f"to compile verify graphs and commit their tokens"
                    )
                paged = paged_for(buffer)
                if paged is None:
                    self.register_buffer(f"cache_{index}", buffer, persistent=False)
                else:  # the pages themselves: a compiled commit takes them as inputs
                    self.register_buffer(f"pool_{index}", paged.pool, persistent=False)
                    self.register_buffer(f"rows_{index}", paged.rows, persistent=False)
                    self.register_buffer("table", paged.table, persistent=False)
                self._records.append(record)
                self._entries.append((index, paged is not None))
                self._batch = record.global_shape[0]

    @property
    def needed(self) -> bool:
        """False on a group of size 1, where verify graphs write in place."""
        return bool(self._records)

    def forward(self, start: torch.Tensor, accepted: torch.Tensor, path: torch.Tensor | None = None) -> None:
        if path is not None and self._records:  # one batch and one staging width for every cache
            record = self._records[0]
            _check_path(path, self._batch, record.verify_tokens)
        for record, (index, paged) in zip(self._records, self._entries):
            layout = record.layout
            width = record.verify_tokens if path is None else path.shape[1]
            steps = torch.arange(width, device=start.device)
            positions = start[:, None] + steps  # [B, T]
            slots = local_slots(
                positions, size=layout.size, rank=layout.rank, interleave=layout.interleave, max_seq_len=layout.max_seq_len
            )
            slots = torch.where(steps < accepted[:, None], slots, layout.trash_slot)
            if paged:
                pool, rows = getattr(self, f"pool_{index}"), getattr(self, f"rows_{index}")
                _commit_to_pages(pool, rows, self.table, slots, path, record)
                continue
            view = cache_BHSD(getattr(self, f"cache_{index}"), seq_dim=record.seq_dim)
            first = layout.local_cache_len
            rows = torch.arange(view.shape[0], device=start.device)[:, None]
            if path is None:
                staged = view[:, :, first : first + record.verify_tokens].transpose(1, 2).clone()  # [B, T, H, D]
            else:
                staged = view[rows, :, first + path]  # advanced indexing copies: [B, T, H, D]
            view[rows, :, slots] = staged


def _commit_to_pages(pool, rows, table, slots: torch.Tensor, path: torch.Tensor | None, record: CacheRecord) -> None:
    """The paged form: staging is ``rows[:, :, 1:]`` (after the trash slot), owners are pages."""
    rows = cache_BHSD(rows, seq_dim=record.seq_dim)
    if path is None:
        staged = rows[:, :, 1 : 1 + record.verify_tokens]  # [B, H, T, D]; store_in_pages copies
    else:
        batch = torch.arange(rows.shape[0], device=path.device)[:, None]
        staged = rows[batch, :, 1 + path].transpose(1, 2)
    store_in_pages(pool, table, slots, staged, capacity=record.layout.local_capacity)


def _check_path(path: torch.Tensor, batch: int, verify_tokens: int) -> None:
    """Shapes only (a captured commit reads no values on the host)."""
    if path.dim() != 2 or path.shape[0] != batch or path.shape[1] > verify_tokens or path.dtype != torch.long:
        raise ValueError(
            f"KVCommit's path must be int64 [batch={batch}, at most verify_tokens={verify_tokens}]: the staging slot "
            f"of each accepted token; got {path.dtype} {tuple(path.shape)} (runtime.tree.commit_slots gives it)"
        )
