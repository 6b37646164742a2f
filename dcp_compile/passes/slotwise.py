"""Keys and values computed slot by slot from the caches, and that computation redone
on the new tokens.

Some models cache something smaller than the keys and values and expand it at every
step: transformers' multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, MiniCPM3, GLM-4
MoE Lite) caches the compressed latent and the rope key, then per layer runs
``kv_b_proj`` over every cached slot, splits the result into per-head ``k_nope`` and
values, broadcasts the rope key over the heads and copies both halves into a fresh key
tensor::

    kv = kv_b_proj(latent_cache).view(B, S, -1, nope + v).transpose(1, 2)
    k_nope, value = torch.split(kv, [nope, v], dim=-1)
    key = kv.new_empty(B, H, S, nope + rope)
    key[..., :nope].copy_(k_nope)
    key[..., nope:].copy_(rope_cache.expand(-1, H, -1, -1))
    sdpa(query, key, value, mask)

Sharding the caches by slot is exact for such a *slot-wise map*: when every op computes
slot ``j`` of its output from slot ``j`` of its inputs (same batch row), the map of a
rank's shard is the shard of the map, and the map of the new tokens is what the cache
would have given at their positions.  ``analyse`` proves that by following two axes,
the batch and the slot, through every op between the caches and the attention; an op
that mixes slots (a reduction or a view across the slot axis), or combines the cache
data with a tensor that varies along the slots, is refused with its source line.
``replay_on_window`` copies the map onto the new tokens, with the slot count in shape
arguments replaced by the number of new tokens.
"""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from dcp_compile.passes.fx_utils import (
    LAYOUT_ONLY, GraphPatternError, arg, expand_ellipsis, fake_value, op_name, shape_of, where,
)
from dcp_compile.passes.kv_index import WRITE_KINDS

_SAME_SHAPE = LAYOUT_ONLY | {"neg", "exp", "rsqrt", "sqrt", "silu", "gelu", "relu", "tanh", "sigmoid"}
_ELEMENTWISE = frozenset({"add", "sub", "mul", "truediv", "div", "__add__", "__sub__", "__mul__", "__truediv__"})
_SPLITS = frozenset({"split", "split_with_sizes", "chunk", "tensor_split"})
_SIZED_VIEWS = frozenset({"view", "reshape", "expand"})
_NEW_TENSORS = frozenset({"new_empty", "new_zeros", "new_ones"})


@dataclass(frozen=True)
class Axes:
    """Where a tensor of the map holds the batch and the cache slots."""

    batch: int
    slot: int


@dataclass(frozen=True)
class SlotwiseMap:
    """The ops from ``caches`` (placeholders) to an attention's keys and values."""

    caches: tuple[Node, ...]
    nodes: tuple[Node, ...]
    """Every op that reads the caches' data, in graph order (in-place copies included)."""
    axes: dict[Node, Axes]
    slots: int
    """Slots of every cache read (this rank's, in a prepared graph)."""


def _refuse(node: Node, why: str) -> GraphPatternError:
    return GraphPatternError(
        f"a KV cache is read by {op_name(node) or node.op!r} at {where(node)}, which the passes cannot shard: {why}. "
        f"Keys and values may be computed from the caches only by ops that treat every cache slot alike and apart "
        f"(linear layers, views that keep the slot axis, splits, concatenation and broadcasts over other axes)"
    )


def _descendants(roots, stops: set[Node], skip) -> list[Node]:
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in stops or user in seen or skip(user):
                continue
            seen.add(user)
            stack.append(user)
    return sorted(seen, key=_order(next(iter(stops)).graph))


def _order(graph: Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _sizes(node: Node) -> list:
    """The size list of ``view(*sizes)``, ``view(sizes)``, ``new_empty(sizes)`` and the like."""
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        return list(rest[0])
    if not rest:
        return list(node.kwargs.get("size", ()))
    return list(rest)


def _intact(axis: int, shape_in, shape_out) -> int | None:
    """Where ``axis`` of ``shape_in`` lands under a reshape to ``shape_out``, if it stays
    one whole axis (the axes before it fold only among themselves); else None."""
    before = math.prod(shape_in[:axis])
    for j, size in enumerate(shape_out):
        if math.prod(shape_out[:j]) == before and size == shape_in[axis]:
            return j
    return None


def _index_axes(node: Node, axes: Axes, ndim: int) -> Axes:
    """``x[index]`` with basic indexing that keeps the batch and slot axes whole."""
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    index = list(expand_ellipsis(index, ndim))
    index += [slice(None)] * (ndim - sum(e is not None for e in index))
    mapping, src, out = {}, 0, 0
    for entry in index:
        if entry is None:
            out += 1
            continue
        if src in (axes.batch, axes.slot) and entry != slice(None):
            raise _refuse(node, f"it indexes the {'slot' if src == axes.slot else 'batch'} axis with {entry!r}")
        if isinstance(entry, slice):
            mapping[src] = out
            out += 1
        elif not isinstance(entry, int):
            raise _refuse(node, f"it indexes with {entry!r}")
        src += 1
    return Axes(mapping[axes.batch], mapping[axes.slot])


def _step(node: Node, axes: dict[Node, Axes], inside: set[Node]) -> Axes | None:
    """The batch and slot axes of ``node``'s output, given its inputs'; ``None`` for a
    node that only writes into the map (an in-place copy).  Raises where ``node`` mixes
    slots or rows."""
    name = op_name(node)
    x = node.args[0] if node.args else None
    if isinstance(x, Node) and x in inside and x not in axes:
        raise _refuse(node, f"it reads {x.name} before the passes could tell its slot axis")
    a = axes.get(x) if isinstance(x, Node) else None
    outside_data = [n for n in node.all_input_nodes if n not in inside]

    if name == "getitem" and a is not None and isinstance(node.args[1], int) and not _is_tensor(x):
        return a  # one piece of a split
    if name == "copy_":
        src = node.args[1]
        if a is None or axes.get(src) != a or shape_of(src) != shape_of(x):
            raise _refuse(node, "it copies a tensor whose batch and slot axes differ from the destination's")
        return None
    if name in _ELEMENTWISE:
        return _elementwise_axes(node, axes, inside)
    if a is None:
        raise _refuse(node, "its first operand is not the cache data")
    ndim_in = len(shape_of(x)) if _is_tensor(x) else None
    if name in ("linear", "matmul", "__matmul__"):
        return _projection_axes(node, a, ndim_in, inside)
    if outside_data and name != "type_as":
        raise _refuse(node, f"it also reads {outside_data[0].name}, which is not cache data")
    return _layout_axes(node, name, x, a, axes, ndim_in)


def _projection_axes(node: Node, a: Axes, ndim_in: int, inside: set[Node]) -> Axes:
    """``linear`` / ``matmul`` of cache data by a weight: it maps the last axis alone, so
    the batch and slot axes stay where they are."""
    weight = node.args[1]
    if weight in inside or len(shape_of(weight)) != 2 or max(a.batch, a.slot) == ndim_in - 1:
        raise _refuse(node, "it is not a projection of the last axis by a weight")
    if any(n in inside for n in node.all_input_nodes[2:]):
        raise _refuse(node, "its bias comes from the cache")
    return a


def _layout_axes(node: Node, name: str, x: Node, a: Axes, axes: dict[Node, Axes], ndim_in: int | None) -> Axes:
    """Where an op that reads cache data alone moves its batch and slot axes (views,
    permutations, splits, indexing, joins); raises for an op that mixes them."""
    shape_out = shape_of(node) if _is_tensor(node) else None
    if name in _SAME_SHAPE or name in _NEW_TENSORS:
        if shape_out != shape_of(x) and name not in _NEW_TENSORS:
            raise _refuse(node, "it changes the shape")
        return a if name not in _NEW_TENSORS else _fresh_axes(node, axes)
    if name in ("transpose", "swapaxes"):
        i, j = (int(d) % ndim_in for d in node.args[1:3])
        swap = {i: j, j: i}
        return Axes(swap.get(a.batch, a.batch), swap.get(a.slot, a.slot))
    if name == "permute":
        dims = [int(d) % ndim_in for d in (node.args[1] if isinstance(node.args[1], (tuple, list)) else node.args[1:])]
        return Axes(dims.index(a.batch), dims.index(a.slot))
    if name == "unsqueeze":
        d = int(node.args[1]) % (ndim_in + 1)
        return Axes(a.batch + (d <= a.batch), a.slot + (d <= a.slot))
    if name in ("view", "reshape", "flatten"):
        batch, slot = _intact(a.batch, shape_of(x), shape_out), _intact(a.slot, shape_of(x), shape_out)
        if batch is None or slot is None:
            raise _refuse(node, f"it reshapes {list(shape_of(x))} to {list(shape_out)}, folding the batch or slot axis")
        return Axes(batch, slot)
    if name == "expand":
        if len(shape_out) != ndim_in or shape_out[a.batch] != shape_of(x)[a.batch] or shape_out[a.slot] != shape_of(x)[a.slot]:
            raise _refuse(node, "it broadcasts along the batch or slot axis")
        return a
    if name in _SPLITS:
        dim = int(arg(node, 2, "dim", 0)) % ndim_in
        if dim in (a.batch, a.slot):
            raise _refuse(node, "it splits the batch or slot axis")
        return a
    if name == "getitem" and _is_tensor(x):
        return _index_axes(node, a, ndim_in)
    if name == "cat":
        parts, dim = node.args[0], int(arg(node, 1, "dim", 0))
        if any(not isinstance(p, Node) or axes.get(p) != axes.get(parts[0]) for p in parts):
            raise _refuse(node, "it joins tensors that are not all cache data with one layout")
        if dim % len(shape_out) in (axes[parts[0]].batch, axes[parts[0]].slot):
            raise _refuse(node, "it concatenates along the batch or slot axis")
        return axes[parts[0]]
    raise _refuse(node, "this op is not known to act slot by slot")


def _elementwise_axes(node: Node, axes: dict[Node, Axes], inside: set[Node]) -> Axes:
    """``a + b`` and the like: every cache-data operand with the output's layout, any
    other operand constant along the slot axis."""
    shape_out = shape_of(node)
    data = [o for o in node.args[:2] if isinstance(o, Node) and o in inside]
    layouts = {axes.get(o) for o in data}
    if len(layouts) != 1 or None in layouts or any(len(shape_of(o)) != len(shape_out) for o in data):
        raise _refuse(node, "its operands hold the slots on different axes")
    a = layouts.pop()
    for operand in node.args[:2]:
        if isinstance(operand, Node) and operand not in inside and _is_tensor(operand):
            shape = shape_of(operand)
            at = a.slot - (len(shape_out) - len(shape))
            if at >= 0 and shape[at] != 1:
                raise _refuse(node, f"{operand.name} varies along the slot axis")
    return a


def _is_tensor(node) -> bool:
    return isinstance(node, Node) and isinstance(fake_value(node), torch.Tensor)


def _fresh_axes(node: Node, axes: dict[Node, Axes]) -> Axes:
    """A tensor created in the map (``key = kv.new_empty(...)``) holds the layout of what
    is copied into it through views that keep every axis."""
    found = set()
    for view in node.users:
        if op_name(view) != "getitem":
            continue
        index = view.args[1] if isinstance(view.args[1], tuple) else (view.args[1],)
        if any(not isinstance(e, slice) and e is not Ellipsis for e in index):
            continue
        for copy in view.users:
            if op_name(copy) == "copy_" and copy.args[0] is view and copy.args[1] in axes:
                found.add(axes[copy.args[1]])
    if len(found) != 1:
        raise _refuse(node, "it creates a tensor that is not filled by copies of cache data in one layout")
    return found.pop()


def analyse(site: Node, operands: list[Node], caches: dict[Node, object], consumers: tuple[Node, ...] = (),
            earlier_sites: AbstractSet[Node] = frozenset()) -> SlotwiseMap | None:
    """The slot-wise map from the caches ``operands`` read to ``operands`` (the site's
    keys and values, which ``site`` and ``consumers`` take: the scores' product of a
    hand-written attention); None when they read no cache.  ``earlier_sites``: attention
    outputs already found, where the search for the caches stops (what comes out of an
    attention is no cache's slots).  Writes into the caches are not part of the map."""
    read = [c for c in _sources(operands, earlier_sites) if c in caches]
    if not read:
        return None

    def is_write(user: Node) -> bool:
        return op_name(user) in WRITE_KINDS and user.args and user.args[0] in caches

    nodes = _descendants(read, {site, *consumers}, is_write)
    inside = set(nodes) | set(read)
    axes: dict[Node, Axes] = {}
    for cache in read:
        seq_dim = caches[cache].seq_dim
        axes[cache] = Axes(0, seq_dim)
    slots = {shape_of(c)[axes[c].slot] for c in read}
    if len(slots) != 1:
        raise GraphPatternError(f"the attention at {where(site)} reads caches of {sorted(slots)} slots; expected one length")
    for node in nodes:
        if node.op not in ("call_function", "call_method"):
            raise _refuse(node, "it is not an op")
        found = _step(node, axes, inside)
        if found is not None:
            axes[node] = found
    return SlotwiseMap(tuple(read), tuple(nodes), axes, slots.pop())


def reads_cache(operand: Node, caches, earlier_sites: AbstractSet[Node]) -> bool:
    """Whether ``operand`` is computed from a cache's slots (not through an attention)."""
    return any(c in caches for c in _sources([operand], earlier_sites))


def _sources(operands: list[Node], earlier_sites: AbstractSet[Node]) -> set[Node]:
    """The graph inputs ``operands`` are computed from, including through in-place copies
    into them (``key[..., :n].copy_(k_nope)``); the walk stops at attention ops and at
    ``earlier_sites``, whose outputs are no longer any cache's slots."""
    stack, seen, inputs = list(operands), set(), set()
    while stack:
        node = stack.pop()
        if not isinstance(node, Node) or node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            inputs.add(node)
        elif node not in earlier_sites and op_name(node) not in ("scaled_dot_product_attention", "softmax"):
            stack.extend(node.all_input_nodes)
            for view in node.users:
                if op_name(view) == "getitem":
                    stack.extend(c.args[1] for c in view.users if op_name(c) == "copy_" and c.args[0] is view)
    return inputs


def replay_on_window(graph: Graph, smap: SlotwiseMap, new_tokens: dict[Node, Node], tokens: int) -> dict[Node, Node]:
    """Copy the map into ``graph`` (at its insertion point) with each cache replaced by
    ``new_tokens[cache]`` (the new tokens in the cache's layout, ``tokens`` of them where
    the cache has ``smap.slots``); returns old node -> copy."""
    env: dict[Node, Node] = dict(new_tokens)
    for node in smap.nodes:
        copy = graph.node_copy(node, lambda n: env.get(n, n))
        copy.meta = {"stack_trace": node.meta.get("stack_trace")}
        name = op_name(node)
        axes = smap.axes.get(node)
        if axes is not None and (name in _SIZED_VIEWS or name in _NEW_TENSORS):
            sizes = _sizes(node)
            if sizes[axes.slot] == smap.slots:  # a -1 stays
                sizes[axes.slot] = tokens
                rest = node.args[1:]
                if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
                    copy.args = (copy.args[0], tuple(sizes))
                elif rest:
                    copy.args = (copy.args[0], *sizes)
                else:
                    copy.kwargs = {**copy.kwargs, "size": tuple(sizes)}
        env[node] = copy
    return env


