"""shard_kv_writes: every KV write stores only the positions this rank owns.

Precondition: ``plan`` was produced by ``find`` on this ``gm``, and the cache buffers
are this rank's local ``S_loc + 1``-slot buffers (``dcp.prepare`` swapped them in).

Invariant established: each write's positions index is replaced by
``local_slots(positions)``: the owner slot for positions this rank owns, the trash slot
``S_loc`` for every other position (and for any position outside ``[0, S)``).  Shapes
stay static and there is no data-dependent control flow.

Never: changes the written values, the write op, or adds aliasing; the values written
to the trash slot are never read (the prefix attention stops at ``local_length``).
"""

from __future__ import annotations

from torch.fx import GraphModule

from dcp_compile.layout import KVLayout
from dcp_compile.passes.find import Plan
from dcp_compile.passes.kv_index import local_slots, replace_positions


def shard_kv_writes(gm: GraphModule, plan: Plan, *, layout: KVLayout) -> GraphModule:
    for write in plan.writes:
        with gm.graph.inserting_before(write.node):
            slots = gm.graph.call_function(
                local_slots,
                (write.positions,),
                dict(size=layout.size, rank=layout.rank, interleave=layout.interleave, max_seq_len=layout.max_seq_len),
            )
        slots.meta["stack_trace"] = write.node.meta.get("stack_trace")
        replace_positions(write.node, write.index, slots)
    gm.recompile()
    return gm
