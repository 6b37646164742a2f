"""check: enforce the invariants the compiled graph must hold before lowering.

Target (after shard_kv_writes + shard_attention):
- exactly one merge per attention site found by ``find``, and one all-gather (``ag``)
  or one all-to-all plus one all-gather (``a2a``);
- each write stores at local slots (owner-or-trash, or staging for verify graphs);
- each cache buffer is used only by its write and by the cascade's prefix read (or the
  slot-wise map a site computes its keys and values with), so no node reads a
  full-length KV tensor.

Draft (no rewrite of its writes):
- zero collectives in the graph;
- every KV write still stores at the positions it stored before the passes ran, or,
  in a tree draft's depth, at the draft's tree slots.

Never modifies the graph; raises ``InvariantError`` (a broken project invariant, not a
user error) naming the offending node.  A real exception, not ``assert``: the checks
must still run under ``python -O``.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.fx import GraphModule

from dcp_compile.ops.cascade import (
    cache_BHSD, local_slots, merge_exchanged, merge_gathered, merge_own_heads, staging_slots,
)
from dcp_compile.passes.find import Plan
from dcp_compile.passes.fx_utils import where
from dcp_compile.passes.kv_index import positions_node
from dcp_compile.passes.shard_attention import ALL_GATHER, ALL_TO_ALL

COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_dtensor")


class InvariantError(RuntimeError):
    """The passes left a graph that breaks an invariant of this module: a bug in dcp-compile."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvariantError(message)


def is_collective(node) -> bool:
    """A collective op: the passes' own (overloads), or one the model traced (Dynamo
    records a functional collective such as a TP all-reduce by its overload packet)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in COLLECTIVE_NAMESPACES
    return target._qualified_op_name.split("::")[0] in COLLECTIVE_NAMESPACES


def count_collectives(gm: GraphModule) -> int:
    return sum(is_collective(node) for node in gm.graph.nodes)


def count_targets(gm: GraphModule) -> Counter:
    return Counter(node.target for node in gm.graph.nodes if node.op == "call_function")


def check_target(gm: GraphModule, plan: Plan, comm: str = "ag", size: int = 2, heads_split: bool = False) -> GraphModule:
    """``size == 1``: the single-GPU cascade, with no collective at all.  ``heads_split``
    (inside TP): each site also all-gathers the peers' queries, and merges its own heads."""
    counts = count_targets(gm)
    sites = len(plan.sites)
    gathers_query = heads_split and size > 1
    if gathers_query:
        merge = merge_own_heads
    else:
        merge = merge_exchanged if comm == "a2a" and size > 1 else merge_gathered
    _require(counts[merge] == sites, f"expected {sites} merges, found {counts[merge]}")
    partial_ag = 0 if size == 1 or (gathers_query and comm == "a2a") else 1
    expected_ag = sites * (partial_ag + gathers_query) if size > 1 else 0
    _require(counts[ALL_GATHER] == expected_ag, f"expected {expected_ag} all-gathers, found {counts[ALL_GATHER]}")
    expected_a2a = sites if comm == "a2a" and size > 1 else 0
    _require(counts[ALL_TO_ALL] == expected_a2a, f"expected {expected_a2a} all-to-alls, found {counts[ALL_TO_ALL]}")
    # Keys and values a slot-wise map computes from the caches: the map itself reads
    # this rank's slots for the prefix.
    map_reads = {node for site in plan.sites if site.expanded for node in site.expanded.map.nodes}
    for write in plan.writes:
        stored_at = positions_node(write.node, write.index)
        # A group of one owns every position: its slots are the global positions.
        _require(
            size == 1 or stored_at.target in (local_slots, staging_slots),
            f"KV write {where(write.node)} still stores at global positions",
        )
        for user in write.cache.node.users:
            ok = user is write.node or (user.target is cache_BHSD and user.op == "call_function") or user in map_reads
            _require(ok, f"KV cache {write.cache.name} is still read in full by {where(user)}")
    return gm


def check_draft(gm: GraphModule, plan: Plan, staged: bool = False) -> GraphModule:
    """``staged``: a tree draft's depth, whose writes go to the tree slots."""
    collectives = [n for n in gm.graph.nodes if is_collective(n)]
    _require(not collectives, f"draft graph holds collectives: {[where(n) for n in collectives]}")
    for write in plan.writes:
        stored_at = positions_node(write.node, write.index)
        if staged:
            _require(stored_at.target is staging_slots, f"tree draft KV write {where(write.node)} does not store at the tree slots")
        else:
            _require(stored_at is write.positions, f"draft KV write {where(write.node)} no longer stores at its own positions")
    return gm
