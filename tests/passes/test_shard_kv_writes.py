import pytest
import torch

from dcp_compile.layout import KVLayout
from dcp_compile.passes import find, shard_kv_writes
from dcp_compile.ops.cascade import local_slots
from dcp_compile.passes.kv_index import positions_node
from tests.support import capture_graph
from tests.passes import graphs

IDIOMS = [graphs.GptFastStyle, graphs.IndexCopyStyle, graphs.IndexPutBSHD]


@pytest.mark.parametrize("module_cls", IDIOMS)
def test_every_write_stores_at_local_slots(module_cls):
    module = module_cls()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    plan = find(gm)
    layout = KVLayout(size=3, rank=1, max_seq_len=graphs.S, interleave=2)
    shard_kv_writes(gm, plan, layout=layout)
    for write in plan.writes:
        slots = positions_node(write.node, write.index)
        assert slots.target is local_slots and slots.args == (write.positions,)
        assert slots.kwargs == dict(size=3, rank=1, interleave=2, max_seq_len=graphs.S)
        assert write.node.op in ("call_function", "call_method")
        assert (write.node.args[0] is write.cache.node), "the write still targets the cache buffer"
    gm.graph.lint()


def test_untouched_graph_without_caches():
    module = graphs.NoCache()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    before = gm.code
    shard_kv_writes(gm, find(gm), layout=KVLayout(2, 0, graphs.S))
    assert gm.code == before


@pytest.mark.parametrize("size,interleave", [(2, 1), (3, 2), (4, 4)])
def test_local_slots_owner_or_trash(size, interleave):
    max_seq_len = 37
    positions = torch.arange(-3, max_seq_len + 5)
    for rank in range(size):
        layout = KVLayout(size, rank, max_seq_len, interleave)
        slots = local_slots(positions, size=size, rank=rank, interleave=interleave, max_seq_len=max_seq_len)
        for p, s in zip(positions.tolist(), slots.tolist()):
            if 0 <= p < max_seq_len and layout.owner(p) == rank:
                assert s == layout.local_slot(p) < layout.local_capacity
            else:
                assert s == layout.trash_slot, f"position {p} must go to the trash slot on rank {rank}"
