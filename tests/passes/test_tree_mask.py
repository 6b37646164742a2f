"""How a tree's ancestor mask enters a graph: ``TreeCall`` passes it beside the positions,
``dcp.backend`` hands it to every window attention, and every other route refuses."""

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.models import LlamaConfig
from dcp_compile.ops.tree_mask import TreeCall
from dcp_compile.passes.shard_attention import WINDOW_ATTENTION
from tests.support import make_model

CFG = LlamaConfig(max_batch=2, max_seq_len=32)


def tree_inputs(nodes=3):
    tokens = torch.randint(0, CFG.vocab_size, (CFG.max_batch, nodes + 1))
    positions = torch.tensor([[4, 5, 5, 6]]).expand(CFG.max_batch, -1)
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    return tokens, positions, ancestors.expand(CFG.max_batch, -1, -1).contiguous()


def prepared(tree=True):
    model = make_model(CFG)
    dcp.prepare(model, dcp.init_group("cpu"), "target", max_batch=CFG.max_batch, max_seq_len=CFG.max_seq_len,
                verify_tokens=4, tree=tree)
    return model


def test_the_backend_hands_the_mask_to_every_window():
    backend = dcp.backend(dcp.init_group("cpu"), verify=True, lowering="aot_eager")
    verify = torch.compile(TreeCall(prepared()), backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        verify(*tree_inputs())
    (graph,) = [c.graph_module.graph for c in backend.compiled]
    (ancestors,) = [n for n in graph.nodes if n.op == "placeholder" and n.meta["example_value"].dtype == torch.bool]
    windows = [n for n in graph.nodes if n.target is WINDOW_ATTENTION]
    assert len(windows) == CFG.n_layers
    assert all(w.kwargs.get("ancestors") is ancestors for w in windows)


def test_a_tree_call_outside_the_backend_is_refused():
    model = make_model(CFG)
    with torch.no_grad(), pytest.raises(RuntimeError, match="ran outside a graph compiled by dcp.backend"):
        TreeCall(model)(*tree_inputs())
    with torch.no_grad(), pytest.raises(Exception, match="ran outside a graph compiled by dcp.backend"):
        torch.compile(TreeCall(model), backend="aot_eager", fullgraph=True)(*tree_inputs())


@pytest.mark.parametrize("verify,tree", [(False, True), (True, False)])
def test_a_tree_needs_a_verify_backend_and_a_tree_target(verify, tree):
    backend = dcp.backend(dcp.init_group("cpu"), verify=verify, lowering="aot_eager")
    compiled = torch.compile(TreeCall(prepared(tree)), backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad(), pytest.raises(Exception, match="a tree verify graph needs dcp.backend"):
        compiled(*tree_inputs())


def test_tree_is_refused_for_a_draft_or_without_staging():
    group = dcp.init_group("cpu")
    with pytest.raises(ValueError, match="tree=True lays out a target's caches"):
        dcp.prepare(make_model(CFG), group, "target", max_batch=2, max_seq_len=32, verify_tokens=0, tree=True)
    with pytest.raises(ValueError, match="tree=True lays out a target's caches"):
        dcp.prepare(make_model(CFG), group, "draft", max_batch=2, max_seq_len=32, verify_tokens=4, tree=True)
