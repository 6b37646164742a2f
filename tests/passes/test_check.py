import pytest
import torch

from dcp_compile.passes import check_draft, find
from dcp_compile.passes.shard_attention import ALL_GATHER
from dcp_compile.testing import capture_graph
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
    with pytest.raises(AssertionError, match="draft graph holds collectives"):
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
    with pytest.raises(AssertionError, match="no longer stores at its own positions"):
        check_draft(gm, plan)
