"""shard_kv_writes: every KV write stores only the positions this rank owns.

Precondition: ``plan`` was produced by ``find`` on this ``gm``, and the cache buffers
are this rank's local ``S_loc + 1``-slot buffers (``dcp.prepare`` swapped them in).

Invariant established: each write's positions index is replaced by
``local_slots(positions)``: the owner slot for positions this rank owns, the trash slot
``S_loc`` for every other position (and for any position outside ``[0, S)``).  Shapes
stay static and there is no data-dependent control flow.

Verify graphs (``staging_first_slot`` given) defer their writes instead: the ``t``-th new
token of each sequence goes to staging slot ``staging_first_slot + t``, past the trash
slot, and ``runtime.commit.KVCommit`` moves the accepted tokens to their owners after
acceptance.  Slots ``[0, S_loc]`` are then untouched by the verify graph.

Never: changes the written values, the write op, or adds aliasing; the values written
to the trash slot are never read (the prefix attention stops at ``local_length``).
"""

from __future__ import annotations

from torch.fx import GraphModule

from dcp_compile.layout import KVLayout
from dcp_compile.passes.find import Plan
from dcp_compile.ops.cascade import local_slots, staging_slots
from dcp_compile.passes.kv_index import replace_positions


def shard_kv_writes(gm: GraphModule, plan: Plan, *, layout: KVLayout, staging_first_slot: int | None = None) -> GraphModule:
    for write in plan.writes:
        if staging_first_slot is None:
            target = local_slots
            options = dict(size=layout.size, rank=layout.rank, interleave=layout.interleave, max_seq_len=layout.max_seq_len)
        else:
            target = staging_slots
            options = dict(shape=write.index.position_shape, tags=write.index.position_tags, first_slot=staging_first_slot)
        with gm.graph.inserting_before(write.node):
            slots = gm.graph.call_function(target, (write.positions,), options)
        slots.meta["stack_trace"] = write.node.meta.get("stack_trace")
        replace_positions(write.node, write.index, slots)
    gm.recompile()
    return gm
