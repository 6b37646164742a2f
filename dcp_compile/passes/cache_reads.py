"""The walk every attention site shares: from a KV cache to an attention operand.

A site's keys and values are a cache read through layout-only views and a GQA head
replication (``read_chain``, checked axis by axis), or computed from caches slot by slot
(``expanded_site``, through ``slotwise``).  ``make_site`` checks both reads of a site
and proves its mask.  Used by ``sdpa_sites`` and ``hand_written_sites``; never modifies
the graph.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from torch.fx import Node

from dcp_compile.passes.causal_mask import prove_causal
from dcp_compile.passes.fx_utils import (
    INDEX_VIEWS,
    LAYOUT_ONLY,
    GraphPatternError,
    arg,
    expand_ellipsis,
    op_name,
    shape_of,
    where,
)
from dcp_compile.passes.plan import AttentionSite, ExpandedKV, KVCache, KVWrite
from dcp_compile.passes.slotwise import Axes
from dcp_compile.passes.slotwise import analyse as analyse_slotwise


def strip_views(node):
    """``node`` with the index views on top of it taken off."""
    while isinstance(node, Node) and op_name(node) in INDEX_VIEWS and node.args:
        node = node.args[0]
    return node


def root_input(node) -> Node | None:
    """The placeholder ``node`` is a view of, following only single-input index views."""
    node = strip_views(node)
    return node if isinstance(node, Node) and node.op == "placeholder" else None


def _dim(d: int, ndim: int) -> int:
    return d % ndim


def _replay_read(chain: list[Node], cache: KVCache, expected: tuple[str, ...] = ("B", "H", "S", "D")) -> int:
    """Follow the ops from the cache to an attention argument, tracking what each axis
    holds; return the head replication factor.  Raises if the result is not a
    ``[B, H*r, S, D]`` read (``expected``: ``[B, H*r, D, S]`` for the keys of a
    hand-written ``q @ k.transpose(-2, -1)``) where query head ``h`` sees cache head
    ``h // r``."""
    tags = ["B", "H", "H", "D"]
    tags[cache.seq_dim] = "S"
    repeat = 1
    for node in chain:
        fail = GraphPatternError(
            f"target attention reads KV cache {cache.name} through {op_name(node)!r} at {where(node)}, a view the "
            f"passes do not understand (expected layout-only views and a GQA head replication)"
        )
        tags, factor = _read_step(node, tags, fail)
        repeat *= factor
        if len(tags) != len(shape_of(node)):
            raise fail
    if tags != list(expected):
        axes = {"S": "seq", "D": "head_dim", "B": "batch", "H": "heads"}
        raise GraphPatternError(
            f"target attention reads KV cache {cache.name} as axes {tags} (ending at {where(chain[-1]) if chain else cache.name}); "
            f"expected [{', '.join(axes[t] for t in expected)}] with heads replicated by repeat_interleave or expand"
        )
    return repeat


def _read_step(node: Node, tags: list[str], fail: GraphPatternError) -> tuple[list[str], int]:
    """What one op of a read chain does to the axes' tags (``B``, ``H``, ``S``, ``D``, a
    unit axis ``1``, a GQA group ``G``), and by how much it replicates the heads."""
    name = op_name(node)
    shape_in, shape_out = shape_of(node.args[0]), shape_of(node)
    tags = list(tags)
    if name in LAYOUT_ONLY:
        if shape_in != shape_out:
            raise fail
        return tags, 1
    if name in ("transpose", "swapaxes"):
        a, b = (_dim(int(d), len(tags)) for d in node.args[1:3])
        tags[a], tags[b] = tags[b], tags[a]
        return tags, 1
    if name == "permute":
        dims = node.args[1] if isinstance(node.args[1], (tuple, list)) else node.args[1:]
        return [tags[_dim(int(d), len(tags))] for d in dims], 1
    if name == "repeat_interleave":
        repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        if not isinstance(repeats, int) or dim is None or tags[_dim(int(dim), len(tags))] != "H":
            raise fail
        return tags, repeats
    if name == "unsqueeze":
        tags.insert(_dim(int(node.args[1]), len(tags) + 1), "1")
        return tags, 1
    if name == "getitem":
        index = expand_ellipsis(node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],), len(tags))
        new_tags, src = [], iter(tags)
        for entry in index:
            if entry is None:
                new_tags.append("1")
            elif entry == slice(None):
                new_tags.append(next(src))
            else:
                raise fail
        return new_tags + list(src), 1
    if name == "expand":
        for d, (old, new) in enumerate(zip(shape_in, shape_out)):
            if old != new:
                if tags[d] != "1":
                    raise fail
                tags[d] = "G"
        return tags, 1
    if name in ("reshape", "view", "flatten"):
        if shape_out == shape_in:
            return tags, 1
        # Folding a GQA group into the heads: [.., H, G, ..] -> [.., H*G, ..].
        merged = next((i for i in range(len(tags) - 1) if tags[i] == "H" and tags[i + 1] == "G"), None)
        if merged is not None and shape_out == (
            shape_in[:merged] + (shape_in[merged] * shape_in[merged + 1],) + shape_in[merged + 2 :]
        ):
            tags[merged : merged + 2] = ["H"]
            return tags, shape_in[merged + 1]
    raise fail


def read_chain(node: Node, caches: dict[Node, KVCache]) -> tuple[KVCache, list[Node]] | None:
    """The single-input op chain from a cache to ``node``; None if it is not one."""
    chain = []
    while node not in caches:
        if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], Node):
            return None
        if len(node.all_input_nodes) != 1:
            return None
        chain.append(node)
        node = node.args[0]
    return caches[node], chain[::-1]


def make_site(node: Node, query: Node, k_read, v_read, writes: dict[Node, KVWrite], scale: float, mask,
               is_causal: bool, k_expected=("B", "H", "S", "D")) -> AttentionSite:
    """The site at ``node`` (the attention's output) once both reads are checked."""
    (k_cache, k_chain), (v_cache, v_chain) = k_read, v_read
    _replay_read(k_chain, k_cache, k_expected)
    _replay_read(v_chain, v_cache)
    if k_cache.node is v_cache.node:
        raise GraphPatternError(f"attention at {where(node)} reads one cache ({k_cache.name}) as both keys and values")
    k_write, v_write = writes[k_cache.node], writes[v_cache.node]
    if k_write.positions is not v_write.positions:
        raise GraphPatternError(
            f"attention at {where(node)} reads caches written at different position tensors "
            f"({where(k_write.node)} and {where(v_write.node)}); expected one positions tensor per layer"
        )
    proof = prove_causal(node, mask, is_causal, k_write.positions, k_write.index.position_tags)
    return AttentionSite(node, query, k_write, v_write, scale, proof)


def expanded_site(node: Node, query: Node, keys: Node, values: Node, caches: dict[Node, KVCache],
                   writes: dict[Node, KVWrite], scale: float, mask, is_causal: bool, earlier: AbstractSet[Node], *,
                   keys_transposed: bool, scores: Node | None = None):
    """Attention whose keys and values a slot-wise map computes from caches, or None if
    they read no cache.  ``earlier``: the sites found before it; ``scores``: the product
    of a hand-written attention that takes the keys."""
    smap = analyse_slotwise(node, [keys, values], caches, (scores,) if scores is not None else (), earlier)
    if smap is None:
        return None
    expected = {keys: Axes(0, 3 if keys_transposed else 2), values: Axes(0, 2)}
    for operand, axes in expected.items():
        found = smap.axes.get(operand)
        if found != axes or len(shape_of(operand)) != 4:
            held = ("are not computed from a KV cache" if found is None
                    else f"hold the batch and cache slots on axes {(found.batch, found.slot)}")
            raise GraphPatternError(
                f"attention at {where(node)} reads {'keys' if operand is keys else 'values'} {operand.name} that "
                f"{held}; expected [batch, heads, slots, width] computed from the caches"
            )
    site_writes = tuple(writes[c] for c in smap.caches)
    first = site_writes[0]
    if any(w.positions is not first.positions for w in site_writes):
        raise GraphPatternError(
            f"attention at {where(node)} reads caches written at different position tensors "
            f"({', '.join(where(w.node) for w in site_writes)}); expected one positions tensor per layer"
        )
    proof = prove_causal(node, mask, is_causal, first.positions, first.index.position_tags)
    expanded = ExpandedKV(smap, keys, values, site_writes)
    return AttentionSite(node, query, first, first, scale, proof, expanded=expanded), [*smap.nodes, node]
