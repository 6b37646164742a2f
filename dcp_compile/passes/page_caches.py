"""page_caches: a target graph's caches read and written through the block table.

Precondition: the target passes ran (``shard_kv_writes`` where the layout asks for it,
then ``shard_attention``), and ``prepare(page_size=P)`` paged every cache this graph
writes: the model's buffer has its local shape but no memory along the sequence axis,
and its slots live in a ``PagedKV`` (``records``): owner slots ``[0, S_loc)`` in the
pool's pages, the trash and staging slots in a per-row buffer.

Invariant established, for each paged cache placeholder ``c``:
- a write at owner or trash slots becomes ``store_in_pages(pool, table, slots, values)``
  (the trash slot, and slots of pages the row does not hold, go to the null page);
- a verify graph's write to staging slots writes the per-row buffer instead, at the same
  slots less ``S_loc``;
- ``prefix_attention(q, c, ...)`` becomes ``paged_prefix_attention(q, pool, table, ...)``
  (MLA's ``latent_prefix_attention``: ``paged_latent_prefix_attention``);
- the window's read of staging slots reads the per-row buffer;
- nothing else reads ``c``.  The pools, the per-row buffers and the table become graph
  inputs after the model's own (``extra_inputs`` says which, in order).

Never: changes a value written or read, or the slots a token's key and value land in.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from dcp_compile.ops.cascade import cache_BHSD, staging_slots, window_positions
from dcp_compile.ops.paged import store_in_pages
from dcp_compile.passes.find import Plan
from dcp_compile.passes.plan import KVWrite
from dcp_compile.passes.fx_utils import GraphPatternError, where
from dcp_compile.passes.kv_index import positions_node
from dcp_compile.passes.shard_attention import new_tokens
from dcp_compile.records import PagedKV

PAGED_FORMS = MappingProxyType({
    torch.ops.dcp.prefix_attention.default: torch.ops.dcp.paged_prefix_attention.default,
    torch.ops.dcp.latent_prefix_attention.default: torch.ops.dcp.paged_latent_prefix_attention.default,
})
"""Each prefix op over a cache, and its form over pools and a block table."""


def static_fakes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fake tensors of fixed sizes, in the compile's fake mode, for graph inputs no user code
    made.  Given to the lowering as plain tensors, AOT autograd would give their sizes
    symbols with no source, which a guard (Inductor's 32-bit indexing check) then cannot name."""
    fake_mode = detect_fake_mode()
    return list(tensors) if fake_mode is None else [fake_mode.from_tensor(t, static_shapes=True) for t in tensors]


def _add_inputs(gm: GraphModule, tensors: dict[str, torch.Tensor]) -> list[Node]:
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    added = []
    for (name, tensor), fake in zip(tensors.items(), static_fakes(list(tensors.values()))):
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(name)
        last.meta["example_value"] = fake
        last._dynamo_source = None  # AOT autograd reads each Dynamo input's source; these come from no user code
        added.append(last)
    return added


def _page_write(graph, write: KVWrite, pool: Node, rows: Node, table: Node, capacity: int) -> None:
    slots = positions_node(write.node, write.index)
    if isinstance(slots, Node) and slots.target is staging_slots:
        # A verify graph's staging write: same write, into the per-row buffer.
        slots.update_kwarg("first_slot", slots.kwargs["first_slot"] - capacity)
        write.node.replace_input_with(write.cache.node, rows)
        return
    with graph.inserting_before(write.node):
        slots_BT = graph.call_function(window_positions, (slots,), dict(
            shape=write.index.position_shape, tags=write.index.position_tags, batch=write.index.batch))
        values = new_tokens(graph, write, write.index.batch)
        graph.call_function(store_in_pages, (pool, table, slots_BT, values), dict(capacity=capacity))
    graph.erase_node(write.node)


def _page_reads(graph, view: Node, pools: dict[Node, Node], rows: Node, table: Node, capacity: int) -> None:
    """Rewrite the users of ``cache_BHSD(c)``: the prefix reads the pools, the window the
    per-row buffer."""
    for user in list(view.users):
        if user.target in PAGED_FORMS:
            q, k, v, kv_len, scale, *bound = user.args
            if k not in pools or v not in pools:
                raise GraphPatternError(f"prefix attention at {where(user)} reads a paged and an unpaged cache")
            with graph.inserting_before(user):
                paged = graph.call_function(PAGED_FORMS[user.target], (q, pools[k], pools[v], table, kv_len, scale,
                                                                       *bound))
            user.replace_all_uses_with(paged)
            graph.erase_node(user)
        elif user.target is torch.narrow and user.args[1] == 2 and user.args[2] >= capacity:
            with graph.inserting_before(user):
                staged = graph.call_function(cache_BHSD, (rows,), dict(view.kwargs))
            user.args = (staged, 2, user.args[2] - capacity, *user.args[3:])
        elif user.users or user.op != "call_function":
            raise GraphPatternError(
                f"{where(user)} reads a paged KV cache in a form the paging pass does not rewrite "
                f"({user.target}); page_size supports caches that the prefix attention and the window read")


def page_caches(gm: GraphModule, plan: Plan, *, paged: dict[int, PagedKV]) -> GraphModule:
    """``paged``: for each paged cache, its graph input index and its ``PagedKV``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tables = {id(p.table): p.table for p in paged.values()}
    if len(tables) != 1:
        raise ValueError(f"a graph's paged caches must share one block table, found {len(tables)}")
    names = [f"dcp_pool_{i}" for i in paged] + [f"dcp_rows_{i}" for i in paged] + ["dcp_block_table"]
    added = _add_inputs(gm, dict(zip(names, extra_inputs(paged))))
    pool_of = dict(zip(paged, added[: len(paged)]))
    rows_of = dict(zip(paged, added[len(paged) : 2 * len(paged)]))
    table = added[-1]
    graph = gm.graph
    views: dict[Node, int] = {}
    for write in plan.writes:
        index = placeholders.index(write.cache.node)
        capacity = paged[index].rows_capacity
        _page_write(graph, write, pool_of[index], rows_of[index], table, capacity)
    for index in paged:
        for user in list(placeholders[index].users):
            if user.target is cache_BHSD:
                views[user] = index
            else:
                raise GraphPatternError(
                    f"{where(user)} computes from the paged KV cache {placeholders[index].name} itself; page_size "
                    f"pages caches that attention reads as they are stored. Prepare this model without page_size")
    pools = {view: pool_of[index] for view, index in views.items()}
    for view, index in views.items():
        _page_reads(graph, view, pools, rows_of[index], table, paged[index].rows_capacity)
    for view in views:
        if not view.users:
            graph.erase_node(view)
    gm.recompile()
    return gm


def extra_inputs(paged: dict[int, PagedKV]) -> list[torch.Tensor]:
    """The tensors ``page_caches`` made graph inputs, in its order."""
    values = list(paged.values())
    return [p.pool for p in values] + [p.rows for p in values] + [values[0].table]

