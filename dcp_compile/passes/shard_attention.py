"""shard_attention: every target attention becomes the prefix + window + merge cascade.

Precondition: ``plan`` came from ``find`` on this ``gm``; ``shard_kv_writes`` may or may
not have run (the cascade reads only slots before each sequence's first new token,
which this step's writes never touch).

Invariant established: each attention site is replaced by

    prefix_r = prefix_attention(q, local cache slots [0, local_length(start_b)))
    gathered = all_gather([out | lse] of prefix_r)     # the one collective per layer
    window   = window_attention(q, new k/v in hand, causal by global position)
    out      = merge(rank 0 .. N-1 prefixes, window)   # fixed order: same bits on every rank

``start_b`` and the window's positions come from the positions the same layer's KV
write stores.  Where a slot-wise map computes the keys and values from the caches
(``AttentionSite.expanded``), the prefix reads what the user's map computes over the
local slots and the window replays the map on the new tokens (``slotwise``).  The
user's own mask over the full cache is not used (it described the unsharded cache), but ``find`` must have proven it to be exactly that position-causal
mask (``causal_mask.prove_causal``), possibly and-ed with key-padding masks over global
positions; a site whose mask is unproven (a sliding window, no mask, anything the
prover does not model) raises ``GraphPatternError`` with the reason and the user's
source line, before anything is rewritten.  A site with key-padding masks reads them at
the positions its slots and new tokens hold, and runs both attentions as the masked
reference (``attention_with_lse``) instead of the length-bounded kernels.  A site whose
only padding is a per-row lower bound (a left-padding mask in the form the prover
proves, ``MaskProof.key_lower_bounds``) keeps the length-bounded kernels: the prefix
reads local slots ``[prefix_starts(lower), kv_len)``, the window the new keys at
positions ``>= lower``.  The window is merged once, after the gather, so it counts once.

Inside tensor parallelism (``heads_split``) the DCP peers hold the same KV heads and
different query heads, so each site runs

    q_group  = all_gather(q of the D peers' heads)      # overlapped with the window
    prefix_r = prefix_attention(q_group, local cache slots)
    mine     = all_to_all([out | lse] by head block)    # comm="a2a"; "ag": all-gather, keep mine
    out      = merge(rank 0 .. N-1 prefixes of my heads, window of my heads)

and the exchange's volume does not grow with the context.

Never: leaves a site unreplaced, or keeps a read of a full cache buffer alive (the
view chains feeding the old attention are erased once orphaned).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

import dcp_compile.ops.attention  # noqa: F401  (registers the dcp:: ops)
from dcp_compile.layout import KVLayout
from dcp_compile.ops.attention import attention_with_lse
from dcp_compile.ops.cascade import (
    BHSD_as_cache, cache_BHSD, join_heads, key_lower_bound, latent_query, merge_exchanged, merge_gathered, merge_own_heads,
    own_heads_of_gathered, pack_partial, prefix_allowed, prefix_lengths, prefix_starts, split_heads, window_allowed,
    window_kv, window_positions,
)
from dcp_compile.passes.find import AttentionSite, ExpandedKV, KVWrite, Plan
from dcp_compile.passes.fx_utils import GraphPatternError, erase_dead_pure_nodes, fake_value, shape_of, where
from dcp_compile.passes.slotwise import replay_on_window

ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
PREFIX_ATTENTION = torch.ops.dcp.prefix_attention.default
LATENT_PREFIX_ATTENTION = torch.ops.dcp.latent_prefix_attention.default
WINDOW_ATTENTION = torch.ops.dcp.window_attention.default
LATENT_WINDOW_ATTENTION = torch.ops.dcp.latent_window_attention.default
COMMS = ("ag", "a2a")
"""How the partials meet: ``"ag"`` all-gathers every rank's ``[out | lse]`` and every
rank merges all heads; ``"a2a"`` sends each rank the partials of its own 1/N of the
heads (all-to-all), merges those, then all-gathers the merged heads (in the output
dtype).  a2a moves fewer bytes and merges 1/N of the heads per rank, for a second
collective per layer; which wins is measured (``benchmarks/bench_merge.py``).  Inside
TP (``heads_split``) each rank merges only its own heads either way: ``"a2a"`` is the
all-to-all alone, ``"ag"`` an all-gather of which each rank keeps its block."""


@dataclass(frozen=True)
class TreeSlots:
    """A tree draft depth's part of the draft's tree slots (``prepare(tree_slots=)``):
    its new tokens are stored at tree slots ``staged..staged+T-1``, and every window
    attends to tree slots ``0..staged-1`` (the nodes of the earlier depths) beside the
    new tokens, under the ancestor mask ``[B, T, staged + T]``."""

    first_slot: int
    """The cache slot of tree slot 0: the draft cache's ``max_seq_len``."""
    staged: int
    """Nodes the earlier depths left in the tree slots."""
    cached: Node
    """``[B]`` the draft cache's length per row: where each prefix stops (the nodes'
    positions start past it)."""


def _keys_transposed(expanded: ExpandedKV) -> bool:
    """``q @ k.transpose(-2, -1)`` takes its keys as ``[B, H, D, S]``."""
    return expanded.map.axes[expanded.keys].slot == 3


def new_tokens(graph, write: KVWrite, batch: int):
    """The new K/V a write stores, as ``[B, H, T, D]`` (the window's keys or values)."""
    return graph.call_function(
        window_kv,
        (write.value,),
        dict(shape=write.index.value_shape, tags=write.index.value_tags, batch=batch, dtype=write.index.cache_dtype),
    )


def _cache_view(graph, write: KVWrite):
    """The cache a write stores into, as ``[B, H, S, D]`` (what the prefix reads)."""
    return graph.call_function(cache_BHSD, (write.cache.node,), dict(seq_dim=write.cache.seq_dim))


def _site_operands(graph, site: AttentionSite):
    """``(query, [keys, values] over the local slots, [keys, values] of the new tokens)``
    for the three kinds of site: two caches, keys and values a slot-wise map computes
    from caches, and MLA's latent (one key head ``[latent | rope key]``)."""
    k_write, v_write, batch = site.k_write, site.v_write, site.k_write.index.batch
    latent, expanded = site.latent, site.expanded
    if expanded is not None:
        # The prefix reads the keys and values the user's map computes over this
        # rank's slots; the window replays that map on the new tokens.
        window_inputs = {
            w.cache.node: graph.call_function(
                BHSD_as_cache, (new_tokens(graph, w, batch),),
                dict(seq_dim=w.cache.seq_dim, ndim=len(shape_of(w.cache.node))))
            for w in expanded.writes
        }
        replayed = replay_on_window(graph, expanded.map, window_inputs, k_write.index.tokens)

        def keys_BHSD(keys):
            return graph.call_function(torch.transpose, (keys, -2, -1)) if _keys_transposed(expanded) else keys

        caches = [keys_BHSD(expanded.keys), expanded.values]
        return site.query, caches, [keys_BHSD(replayed[expanded.keys]), replayed[expanded.values]]
    if latent is None:
        new_kv = [new_tokens(graph, w, batch) for w in (k_write, v_write)]
        return site.query, [_cache_view(graph, w) for w in (k_write, v_write)], new_kv
    # MLA: one key head [latent | rope key], the latent as the values.
    query = site.query if latent.rope_query is None else graph.call_function(
        latent_query, (site.query, latent.rope_query), dict(perm=latent.query_perm))
    # The prefix and the window read the latent and the rope key where they lie.
    new_kv = [new_tokens(graph, k_write, batch), new_tokens(graph, latent.rope_write, batch)]
    return query, [_cache_view(graph, k_write), _cache_view(graph, latent.rope_write)], new_kv


def _prefix_attention(graph, site: AttentionSite, query, caches, positions, kv_len, lower, kv_start,
                      sharding: dict):
    """Attention over this rank's slots before each row's first new token: the masked
    reference where key-padding masks apply, else the length-bounded kernel."""
    key_masks = site.mask.key_masks
    if key_masks:
        expanded = site.expanded
        slots = expanded.map.slots if expanded else fake_value(caches[0].args[0]).shape[caches[0].kwargs["seq_dim"]]
        allowed = graph.call_function(prefix_allowed, (positions, kv_len, *key_masks),
                                      dict(sharding, slots=slots, lower=lower))
        return graph.call_function(attention_with_lse, (query, caches[0], caches[1], allowed, site.scale))
    if site.latent is not None:
        return graph.call_function(LATENT_PREFIX_ATTENTION, (query, caches[0], caches[1], kv_len, site.scale))
    bound = () if kv_start is None else (kv_start,)
    return graph.call_function(PREFIX_ATTENTION, (query, caches[0], caches[1], kv_len, site.scale, *bound))


def _window_attention(graph, site: AttentionSite, query, caches, new_kv, positions, lower, ancestors,
                      slots: TreeSlots | None):
    """Attention over the new tokens, causal by global position, or under the tree's
    ancestor mask where the graph brings one; a tree draft's depth attends to the
    staged nodes in its tree slots too (``slots``)."""
    if slots is not None and slots.staged:
        staged = [graph.call_function(torch.narrow, (cache, 2, slots.first_slot, slots.staged)) for cache in caches]
        keys, values = (graph.call_function(torch.cat, ([old, new],), dict(dim=2)) for old, new in zip(staged, new_kv))
        return graph.call_function(attention_with_lse, (query, keys, values, ancestors, site.scale))
    if site.latent is not None:
        return graph.call_function(LATENT_WINDOW_ATTENTION, (query, new_kv[0], new_kv[1], positions, site.scale))
    key_masks = site.mask.key_masks
    if not key_masks:
        bound = () if lower is None else (lower,)
        tree = {} if ancestors is None else dict(ancestors=ancestors)
        return graph.call_function(WINDOW_ATTENTION, (query, new_kv[0], new_kv[1], positions, site.scale, *bound), tree)
    allowed = graph.call_function(window_allowed, (positions, *key_masks), dict(lower=lower))
    if ancestors is not None:
        allowed = graph.call_function(torch.logical_and, (allowed, ancestors))
    return graph.call_function(attention_with_lse, (query, new_kv[0], new_kv[1], allowed, site.scale))


def _exchange_and_merge(graph, packed, window_attention, layout: KVLayout, group_name: str | None, comm: str,
                        out_dtype: torch.dtype):
    """The partials meet (``comm``) and merge with the window: ``(out, window,
    collective nodes)``.  The window attention is placed between each collective and its
    wait, so it can run while the partials are in flight."""
    if layout.size == 1:
        # A group of one (the single-GPU cascade): its own prefix is all there is.
        window = window_attention()
        window_parts = [graph.call_function(operator.getitem, (window, i)) for i in (0, 1)]
        out = graph.call_function(merge_gathered, (packed, *window_parts), dict(size=1, dtype=out_dtype))
        return out, window, []
    if comm == "ag":
        gathered = graph.call_function(ALL_GATHER, (packed, layout.size, group_name))
        window = window_attention()
        gathered = graph.call_function(WAIT, (gathered,))
        window_parts = [graph.call_function(operator.getitem, (window, i)) for i in (0, 1)]
        out = graph.call_function(merge_gathered, (gathered, *window_parts), dict(size=layout.size, dtype=out_dtype))
        return out, window, [gathered]
    send = graph.call_function(split_heads, (packed,), dict(size=layout.size))
    splits = [1] * layout.size
    exchanged = graph.call_function(ALL_TO_ALL, (send, splits, splits, group_name))
    window = window_attention()
    exchanged = graph.call_function(WAIT, (exchanged,))
    window_parts = [graph.call_function(operator.getitem, (window, i)) for i in (0, 1)]
    merged = graph.call_function(
        merge_exchanged, (exchanged, *window_parts), dict(size=layout.size, rank=layout.rank, dtype=out_dtype)
    )
    gathered = graph.call_function(WAIT, (graph.call_function(ALL_GATHER, (merged, layout.size, group_name)),))
    out = graph.call_function(join_heads, (gathered,), dict(size=layout.size))
    return out, window, [send, exchanged, merged, gathered]


def _gather_heads_exchange_and_merge(graph, query, prefix_attention, window_attention,
                                     layout: KVLayout, group_name: str, comm: str, out_dtype: torch.dtype):
    """The site inside TP, where the DCP peers hold the same KV and different query heads:
    gather the peers' queries, attend to the local shard for all of them, and hand each
    peer the partials of its own heads (``comm``: an all-to-all, or an all-gather from
    which each rank keeps its block), then merge with the window over the local heads.
    ``(out, prefix, packed, window, collective nodes)``; the window runs while the
    queries are in flight."""
    size = layout.size
    mine = graph.call_method("contiguous", (query,))
    gathered_q = graph.call_function(ALL_GATHER, (mine, size, group_name))
    window = window_attention()
    gathered_q = graph.call_function(WAIT, (gathered_q,))
    peers_query = graph.call_function(join_heads, (gathered_q,), dict(size=size))
    prefix = prefix_attention(peers_query)
    packed = graph.call_function(
        pack_partial, (graph.call_function(operator.getitem, (prefix, 0)), graph.call_function(operator.getitem, (prefix, 1)))
    )
    if comm == "a2a":
        send = graph.call_function(split_heads, (packed,), dict(size=size))
        splits = [1] * size
        partials = graph.call_function(WAIT, (graph.call_function(ALL_TO_ALL, (send, splits, splits, group_name)),))
        nodes = [mine, gathered_q, peers_query, send, partials]
    else:
        gathered = graph.call_function(WAIT, (graph.call_function(ALL_GATHER, (packed, size, group_name)),))
        partials = graph.call_function(own_heads_of_gathered, (gathered,), dict(size=size, rank=layout.rank))
        nodes = [mine, gathered_q, peers_query, gathered, partials]
    window_parts = [graph.call_function(operator.getitem, (window, i)) for i in (0, 1)]
    out = graph.call_function(merge_own_heads, (partials, *window_parts), dict(dtype=out_dtype))
    return out, prefix, packed, window, nodes


def _rewrite_site(gm: GraphModule, site: AttentionSite, layout: KVLayout, group_name: str | None, comm: str,
                  ancestors, slots: TreeSlots | None, heads_split: bool = False) -> None:
    """Replace one site by the cascade: operands, prefix, collective with the window, merge."""
    graph = gm.graph
    k_write, latent = site.k_write, site.latent
    sharding = dict(size=layout.size, rank=layout.rank, interleave=layout.interleave, max_seq_len=layout.max_seq_len)
    out_dtype = fake_value(site.node).dtype
    old_inputs = list(site.node.all_input_nodes)
    with graph.inserting_before(site.node):
        positions = graph.call_function(
            window_positions,
            (k_write.positions,),
            dict(shape=k_write.index.position_shape, tags=k_write.index.position_tags, batch=k_write.index.batch),
        )
        query, caches, new_kv = _site_operands(graph, site)
        kv_len = slots.cached if slots is not None else graph.call_function(prefix_lengths, (positions,), sharding)
        if (site.mask.key_masks or site.mask.key_lower_bounds) and latent is not None:
            raise GraphPatternError(f"the latent attention at {where(site.node)} reads a key-padding mask, which MLA sites do not take yet")
        lower, kv_start = _lower_bound(graph, site, positions, sharding)

        def prefix_attention(q):
            return _prefix_attention(graph, site, q, caches, positions, kv_len, lower, kv_start, sharding)

        def window_attention():
            return _window_attention(graph, site, query, caches, new_kv, positions, lower, ancestors, slots)

        if heads_split and layout.size > 1:
            out, prefix, packed, window, comm_nodes = _gather_heads_exchange_and_merge(
                graph, query, prefix_attention, window_attention, layout, group_name, comm, out_dtype)
        else:
            prefix = prefix_attention(query)
            packed = graph.call_function(
                pack_partial,
                (graph.call_function(operator.getitem, (prefix, 0)), graph.call_function(operator.getitem, (prefix, 1)))
            )
            out, window, comm_nodes = _exchange_and_merge(graph, packed, window_attention, layout, group_name, comm,
                                                          out_dtype)
        if latent is not None:
            out = graph.call_function(torch.permute, (out, latent.out_perm))
    for node in (positions, *new_kv, *caches, *([] if slots else [kv_len]), prefix, packed, window, out, *comm_nodes):
        node.meta["stack_trace"] = site.node.meta.get("stack_trace")
    if "example_value" in site.node.meta:  # the merge returns what the attention did: same shape and dtype
        out.meta["example_value"] = site.node.meta["example_value"]
    site.node.replace_all_uses_with(out)
    graph.erase_node(site.node)
    erase_dead_pure_nodes(gm, old_inputs)


def _lower_bound(graph, site: AttentionSite, positions, sharding: dict):
    """The site's left-padding bound as graph values: ``(lower [B] global positions,
    kv_start [B] local slots)``, or ``(None, None)`` without one.  Several bounds meet
    at their largest."""
    lower = None
    for bound in site.mask.key_lower_bounds:
        nodes, coefs = zip(*bound.inputs) if bound.inputs else ((), ())
        value = graph.call_function(key_lower_bound, (positions, *nodes), dict(coefs=coefs, const=bound.const))
        lower = value if lower is None else graph.call_function(torch.maximum, (lower, value))
    if lower is None:
        return None, None
    return lower, graph.call_function(prefix_starts, (lower,), sharding)


def shard_attention(
    gm: GraphModule, plan: Plan, *, layout: KVLayout, group_name: str | None, comm: str = "ag", ancestors=None,
    slots: TreeSlots | None = None, heads_split: bool = False,
) -> GraphModule:
    """``layout.size == 1`` (``group_name`` None): the cascade without a collective.
    ``ancestors``: the graph's tree mask (``ops.tree_mask``), which every window takes
    in place of the causal order of positions.  ``slots``: a tree draft depth's tree
    slots (a whole draft cache only).  ``heads_split``: the DCP peers hold different
    query heads (tensor parallelism): each site gathers the peers' queries first."""
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    for site in plan.sites:
        if not site.mask.proven:
            raise GraphPatternError(site.mask.failure)
        if ancestors is not None and site.latent is not None:
            raise GraphPatternError(
                f"the latent attention at {where(site.node)} is asked to verify a tree, but MLA's window takes no "
                f"tree mask yet; draft chains (topk=1) for MLA targets")
        heads = fake_value(site.query).shape[site.latent.query_perm[1] if site.latent else 1]
        if comm == "a2a" and layout.size > 1 and not heads_split and heads % layout.size:
            raise ValueError(
                f"comm='a2a' splits the {heads} query heads of the attention at {where(site.node)} over {layout.size} "
                f"ranks, which needs heads divisible by the DCP size; use comm='ag' for this model"
            )
    if slots is not None and (layout.size != 1 or ancestors is None):
        raise ValueError("tree slots belong to a tree draft's depth: a whole cache (layout size 1) and a tree mask")
    for site in plan.sites:
        if slots is not None and (site.latent is not None or site.mask.key_masks or site.mask.key_lower_bounds):
            raise GraphPatternError(
                f"the attention at {where(site.node)} reads an MLA latent or a key-padding mask; a tree draft's depth "
                f"takes a plain position-causal attention over per-head keys and values")
        _rewrite_site(gm, site, layout, group_name, comm, ancestors, slots, heads_split)
    gm.recompile()
    return gm
