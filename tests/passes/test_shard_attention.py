import pytest
import torch
import torch.nn.functional as F

from dcp_compile.layout import KVLayout
from dcp_compile.passes import check_target, find, shard_attention, shard_kv_writes
from dcp_compile.passes.check import InvariantError, count_collectives, count_targets
from dcp_compile.passes.fx_utils import is_sdpa
from dcp_compile.ops.cascade import cache_BHSD, merge_exchanged, merge_gathered
from dcp_compile.passes.shard_attention import ALL_GATHER, ALL_TO_ALL, PREFIX_ATTENTION, WAIT
from dcp_compile.models import LlamaConfig
from tests.support import capture_graph, make_model
from tests.passes import graphs

IDIOMS = [graphs.GptFastStyle, graphs.IndexCopyStyle, graphs.IndexPutBSHD]


def decode_graph(cfg: LlamaConfig):
    """The reference model's decode-step graph and its plan."""
    tokens = torch.zeros(cfg.max_batch, 1, dtype=torch.long)
    gm, _ = capture_graph(make_model(cfg), tokens, tokens.clone())
    return gm, find(gm)


def sharded(module, size=2, rank=0):
    gm, inputs = capture_graph(module, *graphs.inputs_for(module))
    plan = find(gm)
    layout = KVLayout(size, rank, graphs.S)
    shard_kv_writes(gm, plan, layout=layout)
    shard_attention(gm, plan, layout=layout, group_name="test-group")
    return gm, plan


@pytest.mark.parametrize("module_cls", IDIOMS)
def test_attention_becomes_one_cascade(module_cls):
    gm, plan = sharded(module_cls())
    counts = count_targets(gm)
    assert counts[PREFIX_ATTENTION] == counts[ALL_GATHER] == counts[WAIT] == counts[merge_gathered] == 1
    assert not any(is_sdpa(n) for n in gm.graph.nodes)
    gather = next(n for n in gm.graph.nodes if n.target is ALL_GATHER)
    assert gather.args[1:] == (2, "test-group")
    for cache in plan.caches:
        users = {u.target for u in cache.node.users}
        assert users <= {cache_BHSD} | {w.node.target for w in plan.writes}
    check_target(gm, plan)
    gm.graph.lint()


def test_reference_model_gets_one_collective_per_layer():
    cfg = LlamaConfig(n_layers=4, gqa="repeat_interleave")
    gm, plan = decode_graph(cfg)
    layout = KVLayout(3, 2, cfg.max_seq_len)
    shard_kv_writes(gm, plan, layout=layout)
    shard_attention(gm, plan, layout=layout, group_name="g")
    check_target(gm, plan)
    assert count_collectives(gm) == 2 * cfg.n_layers  # all-gather + wait per layer
    assert not any(n.op == "call_method" and n.target == "repeat_interleave" for n in gm.graph.nodes), (
        "the full-cache GQA replication is dead after the rewrite and must be gone"
    )


def test_all_to_all_form_exchanges_then_gathers_merged_heads():
    cfg = LlamaConfig(n_layers=2)
    gm, plan = decode_graph(cfg)
    layout = KVLayout(2, 1, cfg.max_seq_len)
    shard_kv_writes(gm, plan, layout=layout)
    shard_attention(gm, plan, layout=layout, group_name="g", comm="a2a")
    check_target(gm, plan, comm="a2a")
    counts = count_targets(gm)
    assert counts[ALL_TO_ALL] == counts[ALL_GATHER] == counts[merge_exchanged] == cfg.n_layers
    assert counts[merge_gathered] == 0
    with pytest.raises(InvariantError, match="expected 2 merges, found 0"):
        check_target(gm, plan, comm="ag")


def test_all_to_all_needs_heads_divisible_by_the_group():
    cfg = LlamaConfig(n_layers=1)  # 4 query heads
    gm, plan = decode_graph(cfg)
    with pytest.raises(ValueError, match="4 query heads .* over 3 ranks.*use comm='ag'"):
        shard_attention(gm, plan, layout=KVLayout(3, 0, cfg.max_seq_len), group_name="g", comm="a2a")


def test_attention_over_in_graph_tensors_is_not_rewritten():
    class Mixed(graphs.GptFastStyle):
        def forward(self, x, input_pos):
            out = super().forward(x, input_pos)
            return F.scaled_dot_product_attention(out, out, out)

    module = Mixed()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    plan = find(gm)
    (site,) = plan.sites
    (in_graph,) = [n for n in gm.graph.nodes if is_sdpa(n) and n is not site.node]
    layout = KVLayout(2, 0, graphs.S)
    shard_kv_writes(gm, plan, layout=layout)
    shard_attention(gm, plan, layout=layout, group_name="test-group")
    assert [n for n in gm.graph.nodes if is_sdpa(n)] == [in_graph], "the in-graph attention stays, as the same node"
    counts = count_targets(gm)
    assert counts[PREFIX_ATTENTION] == counts[ALL_GATHER] == counts[merge_gathered] == 1, "only the site is sharded"
    (merged,) = [n for n in gm.graph.nodes if n.target is merge_gathered]
    assert in_graph.args == (merged, merged, merged) and in_graph.kwargs == {}, "it now reads the cascade's output"
    check_target(gm, plan)


def test_check_target_rejects_an_unsharded_graph():
    module = graphs.GptFastStyle()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    with pytest.raises(InvariantError, match="expected 1 merges, found 0"):
        check_target(gm, find(gm))
