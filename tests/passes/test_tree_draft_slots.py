"""A tree draft's depths keep their nodes in the draft's tree slots: each depth brings
only its own nodes, stores them past the cache, and attends to the cache, to its
ancestors there and to itself.  It must compute what the whole path recomputed in one
call computes, touch nothing but its tree slots, and refuse a cache without the room."""

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.models import DraftConfig, EagleDraft, LlamaConfig
from dcp_compile.models.llama import init_weights
from dcp_compile.ops.tree_mask import TreeCall
from dcp_compile.passes.shard_attention import WINDOW_ATTENTION

CFG = LlamaConfig(vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, intermediate_size=48, n_layers=2, max_batch=2,
                  max_seq_len=24, aux_layers=(0, 1, 2))
TOPK, CACHED = 2, 7
PARENTS = torch.tensor([[1, 1], [0, 1]])  # [B, topk]: the depth-1 node each depth-2 node extends


def prepared_draft(tree_slots=2 * TOPK):
    draft = init_weights(EagleDraft(DraftConfig(CFG, "eagle3")), seed=3).eval()
    example = (torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, 3 * CFG.dim))
    dcp.prepare(draft, dcp.init_group("cpu"), "draft", max_batch=2, max_seq_len=CFG.max_seq_len, example_inputs=example,
                tree_slots=tree_slots)
    with torch.no_grad():
        for cache in (draft.attention.k_cache, draft.attention.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(5)))
    return draft


def depth_inputs():
    gen = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, CFG.vocab_size, (2, TOPK), generator=gen) for _ in range(2)]
    features = [torch.randn(2, TOPK, CFG.dim, generator=gen) for _ in range(2)]
    return tokens, features


def test_staged_depths_compute_what_the_recomputed_paths_compute():
    draft = prepared_draft()
    backend = dcp.backend(dcp.init_group("cpu"), "draft", lowering="aot_eager")
    depths = [torch.compile(TreeCall(draft, staged=True), backend=backend, fullgraph=True, dynamic=False)
              for _ in range(2)]
    (tokens_1, tokens_2), (features_1, features_2) = depth_inputs()
    cached = torch.full((2,), CACHED)
    own = torch.eye(TOPK, dtype=torch.bool).expand(2, TOPK, TOPK)
    seen_parent = torch.nn.functional.one_hot(PARENTS, TOPK).bool()  # [B, topk, topk] over the depth-1 slots
    before = draft.attention.k_cache.clone()
    with torch.no_grad():
        depths[0](tokens_1, cached[:, None].expand(2, TOPK), own.contiguous(), cached, features_1)
        staged_logits, staged_hidden = depths[1](tokens_2, (cached + 1)[:, None].expand(2, TOPK),
                                                 torch.cat([seen_parent, own], dim=2), cached, features_2)
    after = draft.attention.k_cache
    assert torch.equal(after[:, :, :CFG.max_seq_len], before[:, :, :CFG.max_seq_len]), "only the tree slots change"
    assert not torch.equal(after[:, :, CFG.max_seq_len:], before[:, :, CFG.max_seq_len:])

    # The reference: each depth-2 node's whole path in one call, every path seeing only itself.
    path_tokens = torch.stack([tokens_1.gather(1, PARENTS), tokens_2], dim=2).reshape(2, 2 * TOPK)
    path_features = torch.stack([features_1.gather(1, PARENTS[..., None].expand(2, TOPK, CFG.dim)), features_2],
                                dim=2).reshape(2, 2 * TOPK, CFG.dim)
    index = torch.arange(2 * TOPK)
    block_causal = (index[:, None] // 2 == index[None, :] // 2) & (index[None, :] <= index[:, None])
    positions = cached[:, None] + (index % 2)
    recompute = torch.compile(TreeCall(draft), backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        logits, hidden = recompute(path_tokens, positions, block_causal.expand(2, -1, -1).contiguous(), path_features)
    torch.testing.assert_close(staged_logits, logits[:, 1::2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(staged_hidden, hidden[:, 1::2], rtol=1e-5, atol=1e-5)
    first, second = (c.graph_module.graph for c in backend.compiled[:2])
    assert sum(n.target is WINDOW_ATTENTION for n in first.nodes) == 1, "depth 1 sees only itself: the window kernel"
    assert not any(n.target is WINDOW_ATTENTION for n in second.nodes), "depth 2 reads its ancestors beside itself"


def test_a_depth_past_the_reserved_tree_slots_is_refused():
    draft = prepared_draft(tree_slots=TOPK)
    backend = dcp.backend(dcp.init_group("cpu"), "draft", lowering="aot_eager")
    depth = torch.compile(TreeCall(draft, staged=True), backend=backend, fullgraph=True, dynamic=False)
    (_, tokens), (_, features) = depth_inputs()
    ancestors = torch.ones(2, TOPK, 2 * TOPK, dtype=torch.bool)
    with torch.no_grad(), pytest.raises(Exception, match=r"prepare reserved tree_slots=2 .* tree_slots=4\)"):
        depth(tokens, torch.full((2, TOPK), CACHED + 1), ancestors, torch.full((2,), CACHED), features)


def test_tree_slots_belong_to_a_draft_and_staged_calls_to_the_draft_backend():
    from tests.support import make_model

    with pytest.raises(ValueError, match="tree_slots gives a draft's cache room"):
        dcp.prepare(make_model(LlamaConfig(max_batch=2, max_seq_len=32)), dcp.init_group("cpu"), "target", max_batch=2,
                    max_seq_len=32, tree_slots=4)
    target = make_model(LlamaConfig(max_batch=2, max_seq_len=32))
    dcp.prepare(target, dcp.init_group("cpu"), "target", max_batch=2, max_seq_len=32, verify_tokens=3, tree=True)
    verify = torch.compile(TreeCall(target, staged=True), backend=dcp.backend(dcp.init_group("cpu"), verify=True,
                           lowering="aot_eager"), fullgraph=True, dynamic=False)
    with torch.no_grad(), pytest.raises(Exception, match="is a draft's depth: compile it with"):
        verify(torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), 4), torch.ones(2, 3, 3, dtype=torch.bool),
               torch.full((2,), 4))
