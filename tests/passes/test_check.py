import pytest
import torch

from dcp_compile.layout import KVLayout
from dcp_compile.passes import check_draft, check_target, find, shard_attention, shard_kv_writes
from dcp_compile.passes.check import InvariantError
from dcp_compile.passes.shard_attention import ALL_GATHER
from tests.support import capture_graph
from tests.passes import graphs


def test_check_draft_accepts_an_untouched_graph():
    module = graphs.GptFastStyle()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    check_draft(gm, find(gm))


def test_check_draft_rejects_a_collective():
    module = graphs.GptFastStyle()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    plan = find(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        gm.graph.call_function(ALL_GATHER, (output.args[0][0], 2, "g"))
    with pytest.raises(InvariantError, match="draft graph holds collectives"):
        check_draft(gm, plan)


def test_check_draft_rejects_a_moved_write():
    module = graphs.GptFastStyle()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    plan = find(gm)
    write = plan.writes[0].node
    with gm.graph.inserting_before(write):
        moved = gm.graph.call_function(torch.add, (plan.writes[0].positions, 1))
    args = list(write.args)
    args[1] = (args[1][0], args[1][1], moved)
    write.args = tuple(args)
    with pytest.raises(InvariantError, match="no longer stores at its own positions"):
        check_draft(gm, plan)


def test_check_target_rejects_a_write_left_at_global_positions():
    module = graphs.GptFastStyle()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    plan = find(gm)
    shard_attention(gm, plan, layout=KVLayout(2, 0, graphs.S), group_name="g")  # shard_kv_writes skipped
    with pytest.raises(InvariantError, match="still stores at global positions") as error:
        check_target(gm, plan)
    assert "FX node" in str(error.value)


def test_check_target_rejects_a_full_read_of_a_cache():
    module = graphs.GptFastStyle()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    plan = find(gm)
    layout = KVLayout(2, 0, graphs.S)
    shard_kv_writes(gm, plan, layout=layout)
    shard_attention(gm, plan, layout=layout, group_name="g")
    check_target(gm, plan)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        read = gm.graph.call_function(torch.sum, (plan.caches[0].node,))
    expected = f"KV cache {plan.caches[0].name} is still read in full by FX node '{read.name}'"
    with pytest.raises(InvariantError, match=expected):
        check_target(gm, plan)
