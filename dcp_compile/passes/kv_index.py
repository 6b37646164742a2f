"""How a KV write addresses its cache, reduced to static facts.

A KV cache is a 4-D buffer with the batch first, the head size last, and the heads and
the sequence in the middle (``[B, H, S, D]`` as in gpt-fast and Hugging Face, or
``[B, S, H, D]``), or a 3-D ``[B, S, width]`` buffer with no head axis (MLA's latent and
rope-key caches).  A write stores the new tokens' keys or values at their global
positions, through ``index_copy_(seq_dim, pos, src)``, ``cache[..., pos, ...] = src`` or
``index_put_((batch_idx, pos), src)``, optionally with a ``torch.arange`` batch index so
that every sequence has its own positions.

``analyse_write`` applies numpy's advanced-indexing rules to the write's static shapes
to learn which axis of the written value is the batch, the heads, the new tokens and
the head size.  From those facts ``ops.cascade.window_kv`` and ``window_positions``
rebuild ``[B, H, T, D]`` and ``[B, T]`` at step time from the very tensors the write
stored, so the window attention sees exactly what an unsharded cache would have held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from dcp_compile.passes.fx_utils import (
    INDEX_VIEWS, GraphPatternError, arange_bounds, arg, expand_ellipsis, op_name, shape_of, where,
)

WRITE_KINDS = ("index_copy_", "index_put_", "setitem")


@dataclass(frozen=True)
class WriteIndex:
    """Static description of one KV write."""

    kind: str
    """``"index_copy_"``, ``"index_put_"`` or ``"setitem"``."""
    seq_dim: int
    """Cache axis holding token positions."""
    position_arg: tuple[int, ...]
    """Where the positions tensor sits in ``node.args``: ``(2,)`` for index_copy_, else
    ``(1, i)`` for entry ``i`` of the index tuple."""
    value_shape: tuple[int, ...]
    """Shape the written value is broadcast to."""
    value_tags: tuple[str, ...]
    """Per value axis: ``B`` batch, ``H`` heads, ``T`` new tokens, ``D`` head size, ``1`` unit."""
    position_shape: tuple[int, ...]
    """Broadcast shape of the index tensors."""
    position_tags: tuple[str, ...]
    """Per broadcast axis: ``B``, ``T`` or ``1``."""
    batch: int
    cache_dtype: torch.dtype

    @property
    def tokens(self) -> int:
        """New tokens per sequence this write stores."""
        tags, shape = self.position_tags, self.position_shape
        return shape[tags.index("T")] if "T" in tags else 1


def _full_slice(entry) -> bool:
    return isinstance(entry, slice) and entry == slice(None, None, None)


def _covers(entry, size: int | None) -> bool:
    """A slice such as ``[:bsz]`` that spans an axis of ``size`` (still refused: the
    error names another entry first, the one that matters)."""
    return (isinstance(entry, slice) and size is not None and entry.start in (None, 0) and entry.step in (None, 1)
            and isinstance(entry.stop, int) and entry.stop >= size)


def is_arange(node, length: int) -> bool:
    """Whether ``node`` is ``torch.arange(length)`` up to unit axes and dtype casts."""
    while isinstance(node, Node):
        bounds = arange_bounds(node)
        if bounds is not None:
            return bounds == (0, length, 1)
        name = op_name(node)
        if name == "getitem":
            index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            if not all(_full_slice(e) or e is None or e is Ellipsis for e in index):
                return False
        elif name not in INDEX_VIEWS or name in ("squeeze", "flatten"):
            return False
        node = node.args[0]
    return False


def _write_entries(node: Node, ndim: int) -> list:
    """Per cache axis, the tensor index node or ``None`` for a full slice."""
    kind = op_name(node)
    raw = node.args[1]
    if kind == "index_put_":
        entries = list(raw)
        if len(node.args) > 3 and node.args[3] or node.kwargs.get("accumulate", False):
            raise GraphPatternError(f"KV write with accumulate=True at {where(node)} is not a cache store")
    else:
        entries = list(expand_ellipsis(tuple(raw) if isinstance(raw, (tuple, list)) else (raw,), ndim))
    entries += [slice(None)] * (ndim - len(entries))
    cache = node.args[0]
    sizes = tuple(cache.meta["example_value"].shape) if isinstance(cache, Node) and isinstance(
        cache.meta.get("example_value"), torch.Tensor) else (None,) * ndim
    out, refused = [], []
    for entry, size in zip(entries, sizes):
        if isinstance(entry, Node) and isinstance(entry.meta.get("example_value"), torch.Tensor):
            out.append(entry)
        elif _full_slice(entry):
            out.append(None)
        else:
            refused.append((_covers(entry, size), entry))
    if refused:
        entry = min(refused, key=lambda r: r[0])[1]
        raise GraphPatternError(
            f"KV write at {where(node)} indexes the cache with {entry!r}; expected full slices "
            f"and integer tensors (positions, and optionally torch.arange over the batch). A cache "
            f"written through a Python-int slice (DeepSeek's `kv_cache[:bsz, start_pos:end_pos] = kv`) "
            f"bakes the step's position into the graph, so every step would compile anew and the "
            f"layout could not shard it: pass the positions as a [B, T] tensor, write "
            f"`kv_cache[torch.arange(B)[:, None], positions] = kv`, read the whole cache with a mask "
            f"`slot <= position` (dcp_compile/models/mla.py is the latent form written so)"
        )
    return out


def analyse_write(node: Node, cache: Node) -> WriteIndex:
    """Describe the KV write ``node`` into the cache placeholder ``cache``."""
    cache_shape = shape_of(cache)
    if len(cache_shape) not in (3, 4):
        raise GraphPatternError(
            f"KV cache {cache.name} written at {where(node)} has shape {cache_shape}; expected a 4-D "
            f"[batch, heads, seq, head_dim] or [batch, seq, heads, head_dim] buffer, or a 3-D [batch, seq, width] "
            f"one (MLA's latent cache)"
        )
    cache_dtype = cache.meta["example_value"].dtype
    if op_name(node) == "index_copy_":
        return _index_copy_write(node, cache_shape, cache_dtype)
    return _indexed_write(node, cache_shape, cache_dtype)


def _index_copy_write(node: Node, cache_shape: tuple[int, ...], cache_dtype: torch.dtype) -> WriteIndex:
    """``cache.index_copy_(seq_dim, positions [T], value)``: every row at the same positions."""
    ndim = len(cache_shape)
    seq_dim = int(arg(node, 1, "dim")) % ndim
    allowed = (1, 2) if ndim == 4 else (1,)
    if seq_dim not in allowed:
        raise GraphPatternError(f"index_copy_ at {where(node)} writes along dim {seq_dim}; expected dim {' or '.join(map(str, allowed))}")
    tokens = shape_of(arg(node, 2, "index"))[0]
    tags = ["B", "H", "H", "D"] if ndim == 4 else ["B", "T", "D"]
    tags[seq_dim] = "T"
    value_shape = list(cache_shape)
    value_shape[seq_dim] = tokens
    return WriteIndex("index_copy_", seq_dim, (2,), tuple(value_shape), tuple(tags), (tokens,), ("T",),
                      cache_shape[0], cache_dtype)


def _position_tags(index_shapes: dict[int, tuple[int, ...]], bshape, seq_dim: int, batch_indexed: bool) -> list[str]:
    """Per axis of the broadcast index shape: ``B`` where the batch index varies, ``T``
    where the positions do, ``1`` elsewhere."""

    def varies(d: int, axis: int) -> bool:
        shape = index_shapes[d]
        k = axis - (len(bshape) - len(shape))
        return k >= 0 and shape[k] > 1

    return ["B" if batch_indexed and varies(0, axis) else "T" if varies(seq_dim, axis) else "1"
            for axis in range(len(bshape))]


def _indexed_write(node: Node, cache_shape: tuple[int, ...], cache_dtype: torch.dtype) -> WriteIndex:
    """``cache[..., positions, ...] = value`` or ``index_put_``, with numpy's advanced-indexing
    rules deciding where the index axes land in the written value."""
    batch, ndim = cache_shape[0], len(cache_shape)
    entries = _write_entries(node, ndim)
    if entries[-1] is not None:
        raise GraphPatternError(f"KV write at {where(node)} indexes the head-size axis; expected a full slice there")
    indexed = [d for d, e in enumerate(entries) if e is not None]
    batch_indexed = entries[0] is not None
    if batch_indexed and not is_arange(entries[0], batch):
        raise GraphPatternError(
            f"KV write at {where(node)} indexes the batch axis with {entries[0].name}; expected "
            f"torch.arange({batch}) (every row writes its own sequence)"
        )
    seq_dims = [d for d in indexed if d != 0]
    if len(seq_dims) != 1 or seq_dims[0] not in (1, 2)[: ndim - 2]:
        raise GraphPatternError(
            f"KV write at {where(node)} indexes cache axes {indexed}; expected one position index on "
            f"axis {'1 or 2' if ndim == 4 else '1'}, plus optionally torch.arange over the batch on axis 0"
        )
    seq_dim = seq_dims[0]
    index_shapes = {d: shape_of(entries[d]) for d in indexed}
    bshape = tuple(torch.broadcast_shapes(*index_shapes.values()))
    position_tags = _position_tags(index_shapes, bshape, seq_dim, batch_indexed)
    if position_tags.count("B") > 1 or position_tags.count("T") > 1:
        raise GraphPatternError(
            f"KV write at {where(node)} uses index shapes {list(index_shapes.values())}; expected "
            f"positions of shape [T] or [B, T] and a batch index broadcasting along one axis"
        )
    cache_tags = {0: "B", 3: "D", seq_dim: "S", 3 - seq_dim: "H"} if ndim == 4 else {0: "B", 1: "S", 2: "D"}
    if indexed == list(range(indexed[0], indexed[-1] + 1)):
        # Adjacent index axes: the broadcast index shape takes their place.
        value_tags = [cache_tags[d] for d in range(indexed[0])] + position_tags
        value_tags += [cache_tags[d] for d in range(indexed[-1] + 1, ndim)]
        value_shape = list(cache_shape[: indexed[0]]) + list(bshape) + list(cache_shape[indexed[-1] + 1 :])
    else:
        # Separated index axes: the broadcast index shape goes first.
        rest = [d for d in range(ndim) if d not in indexed]
        value_tags = position_tags + [cache_tags[d] for d in rest]
        value_shape = list(bshape) + [cache_shape[d] for d in rest]
    slot = entries.index(entries[seq_dim])
    return WriteIndex(
        op_name(node), seq_dim, (1, slot), tuple(value_shape), tuple(value_tags), bshape, tuple(position_tags), batch,
        cache_dtype,
    )


def positions_node(write: Node, index: WriteIndex) -> Node:
    if index.position_arg == (2,):
        return arg(write, 2, "index")
    return write.args[1][index.position_arg[1]] if isinstance(write.args[1], (tuple, list)) else write.args[1]


def replace_positions(write: Node, index: WriteIndex, new_positions: Node) -> None:
    """Point the write at ``new_positions`` instead of its global positions."""
    args = list(write.args)
    if index.position_arg == (2,):
        if len(args) > 2:
            args[2] = new_positions
        else:
            write.update_kwarg("index", new_positions)
    else:
        entries = args[1]
        if isinstance(entries, (tuple, list)):
            entries = list(entries)
            entries[index.position_arg[1]] = new_positions
            args[1] = tuple(entries) if isinstance(args[1], tuple) else entries
        else:
            args[1] = new_positions
    write.args = tuple(args)
