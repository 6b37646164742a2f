"""find: locate the KV caches, their writes, and the attention calls that read them.

Precondition: ``gm`` is a Dynamo FX graph (torch-level ops) whose placeholders carry
``example_value`` fake tensors and whose nodes carry ``stack_trace``.

Result: a ``Plan``: the typed facts every later pass consumes, so nothing re-discovers
what this pass found.
- A *KV cache* is a graph input written in place along a sequence axis by
  ``index_copy_``, ``index_put_`` or ``__setitem__`` with a tensor of positions.
- An *attention site* is an ``F.scaled_dot_product_attention`` call, or attention
  written by hand (``softmax(q @ k.transpose(-2, -1) * scale + mask) @ v``), whose keys
  and values are caches, read directly or through a GQA replication (``enable_gqa``,
  ``repeat_interleave`` or ``expand`` + ``reshape``) and layout-only views, or computed
  from caches by a slot-wise map (``slotwise``: transformers' latent attention expands
  its cached latent per head with ``kv_b_proj``; ``AttentionSite.expanded``).

Each site also carries a ``MaskProof`` (``causal_mask``): whether its mask is the
position-causal one that the cascade computes.  An unproven mask is not an error here
(draft graphs and a group of one are never rewritten); ``shard_attention`` and
``dcp.prepare`` refuse it for sharded targets.

Invariant: every read of a cache is part of an attention site or a write.  Any other
read (a matmul over the cache, a view this pass does not understand, flex_attention)
raises ``GraphPatternError`` naming the node and the user's source line: a target
attention is never silently left unsharded.  Attention over tensors that do not come
from a cache is not a site and is left alone.

This pass never modifies the graph.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from dcp_compile.passes.cache_reads import root_input, strip_views
from dcp_compile.passes.fx_utils import (
    GraphPatternError,
    arange_bounds,
    arg,
    fake_value,
    is_flex_attention,
    is_sdpa,
    op_name,
    placeholder_name,
    where,
)
from dcp_compile.passes.hand_written_sites import einsum_site, matmul_site
from dcp_compile.passes.kv_index import WRITE_KINDS, analyse_write, positions_node
from dcp_compile.passes.plan import AttentionSite, ExpandedKV, KVCache, KVWrite, LatentParts, Plan
from dcp_compile.passes.sdpa_sites import sdpa_site

__all__ = ["AttentionSite", "ExpandedKV", "KVCache", "KVWrite", "LatentParts", "Plan", "find"]


def _placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _arange_reach(node) -> int | None:
    """``T - 1`` for ``arange(T)`` or ``arange(0, T)`` with constant ``T`` (through views)."""
    bounds = arange_bounds(strip_views(node))
    if bounds is None:
        return None
    start, end, step = bounds
    if start != 0 or step != 1 or not isinstance(end, int) or end < 1:
        return None
    return end - 1


def _position_source(node) -> tuple[Node, int] | None:
    """The placeholder that written positions come from, and their reach past its values."""
    root = root_input(node)
    if root is not None:
        return root, 0
    node = strip_views(node)
    if isinstance(node, Node) and op_name(node) == "add" and len(node.args) == 2:
        for base, offset in (node.args, node.args[::-1]):
            root, reach = root_input(base), _arange_reach(offset)
            if root is not None and reach is not None:
                return root, reach
    return None


def collect_writes(gm: GraphModule, input_index: dict[Node, int]) -> dict[Node, KVWrite]:
    """Every KV write, by the cache it writes: one write per cache, into the cache itself."""
    writes_by_cache: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if op_name(node) not in WRITE_KINDS or not node.args or not isinstance(node.args[0], Node):
            continue
        target = node.args[0]
        if target.op == "placeholder":
            writes_by_cache.setdefault(target, []).append(node)
        elif root_input(target) is not None and isinstance(fake_value(node.args[0]), torch.Tensor):
            raise GraphPatternError(
                f"{op_name(node)} at {where(node)} writes into a view of graph input "
                f"{placeholder_name(root_input(target))}; expected KV writes into the cache buffer itself"
            )
    writes: dict[Node, KVWrite] = {}
    for cache_node, write_nodes in writes_by_cache.items():
        if len(write_nodes) != 1:
            lines = "; ".join(where(w) for w in write_nodes)
            raise GraphPatternError(
                f"KV cache {placeholder_name(cache_node)} is written {len(write_nodes)} times in one graph ({lines}); "
                f"expected one write per cache per forward"
            )
        write_node = write_nodes[0]
        index = analyse_write(write_node, cache_node)
        cache = KVCache(cache_node, input_index[cache_node], placeholder_name(cache_node), index.seq_dim)
        value = arg(write_node, 3, "source") if index.kind == "index_copy_" else write_node.args[2]
        writes[cache_node] = KVWrite(write_node, cache, index, positions_node(write_node, index), value)
    return writes


def _collect_sites(gm: GraphModule, writes: dict[Node, KVWrite]) -> tuple[list[AttentionSite], set[Node]]:
    """Every attention over two caches (SDPA, or written by hand), with its mask proof;
    and the nodes those reads explain."""
    caches = {node: w.cache for node, w in writes.items()}
    sites: list[AttentionSite] = []
    explained: set[Node] = {w.node for w in writes.values()}
    earlier: set[Node] = set()  # the sites found so far: a later site's search for its caches stops there
    for node in gm.graph.nodes:
        if is_sdpa(node):
            found = sdpa_site(node, caches, writes, earlier)
        elif op_name(node) == "einsum":
            found = einsum_site(node, caches, writes)
        else:
            found = matmul_site(node, caches, writes, earlier)
        if found is not None:
            site, nodes = found
            sites.append(site)
            earlier.add(site.node)
            explained.update(nodes)
    return sites, explained


def _check_reads(gm: GraphModule, caches, explained: set[Node], site_nodes: set[Node]) -> None:
    """Everything that consumes cache data must be a write, a recognised view chain, or
    a site (whose output is attention, no longer cache data)."""
    frontier, seen, unexplained = list(caches), set(caches), []
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user not in explained:
                unexplained.append(user)
            elif user not in site_nodes and op_name(user) not in WRITE_KINDS:
                frontier.append(user)
    if not unexplained:
        return
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    first = min(unexplained, key=order.__getitem__)
    if is_flex_attention(first):
        raise GraphPatternError(
            f"flex_attention over a KV cache at {where(first)} is not supported yet; "
            f"use F.scaled_dot_product_attention for attention over the cache"
        )
    raise GraphPatternError(
        f"a KV cache is read by {op_name(first) or first.op!r} at {where(first)}, which the passes cannot "
        f"shard; read caches only through F.scaled_dot_product_attention, softmax(q @ k.transpose(-2, -1) * "
        f"scale + mask) @ v, or MLA's absorbed einsum form, directly or through layout views and a GQA head "
        f"replication"
    )


def find(gm: GraphModule) -> Plan:
    """Analyse ``gm``; see the module docstring for what is found and what raises."""
    input_index = {node: i for i, node in enumerate(_placeholders(gm))}
    writes = collect_writes(gm, input_index)
    sites, explained = _collect_sites(gm, writes)
    _check_reads(gm, list(writes), explained, {site.node for site in sites})
    mask_inputs = {input_index[t] for site in sites if site.mask.proven for t in site.mask.tables}
    position_inputs = {
        (input_index[source[0]], source[1])
        for w in writes.values() if (source := _position_source(w.positions)) is not None
    }
    return Plan(
        caches=tuple(w.cache for w in writes.values()),
        writes=tuple(writes.values()),
        sites=tuple(sites),
        mask_inputs=tuple(sorted(mask_inputs)),
        position_inputs=tuple(sorted(position_inputs)),
    )
