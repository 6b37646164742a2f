"""Keys and values computed from the caches slot by slot (transformers' multi-head latent
attention expands a cached latent with ``kv_b_proj`` at every step): found, rewritten so
that the prefix reads the map over the local slots and the window replays it on the new
tokens, or refused with the op that mixes slots and its line."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from dcp_compile.layout import KVLayout
from dcp_compile.passes import GraphPatternError, check_target, find, shard_attention, shard_kv_writes
from dcp_compile.passes.shard_attention import ALL_GATHER, PREFIX_ATTENTION, WINDOW_ATTENTION
from tests.support import capture_graph

B, S, T, H, C, R, NOPE, V = 2, 16, 3, 4, 8, 4, 6, 5


class ExpandedLatent(nn.Module):
    """transformers' ``DeepseekV3Attention`` after the cache update, as its file writes it:
    the latent cache expanded per head by ``kv_b_proj``, the rope key broadcast over the
    heads and both copied into a fresh key tensor.  ``flaw`` breaks slot-wise-ness."""

    def __init__(self, flaw=None, eager=False):
        super().__init__()
        self.flaw, self.eager = flaw, eager
        torch.manual_seed(0)
        self.kv_b_proj = nn.Linear(C, H * (NOPE + V), bias=False)
        self.register_buffer("latent_cache", torch.randn(B, 1, S, C))  # stale slots: the masks must hide them
        self.register_buffer("rope_cache", torch.randn(B, 1, S, R))
        self.register_buffer("slot_bias", torch.randn(S, NOPE + R))

    def forward(self, query, latent, rope, positions):
        self.latent_cache.index_copy_(2, positions, latent)
        self.rope_cache.index_copy_(2, positions, rope)
        cached = self.latent_cache
        if self.flaw == "cumsum":
            cached = cached.cumsum(2)  # CUMSUM
        if self.flaw == "fold":
            kv = self.kv_b_proj(cached).view(B, H, S, NOPE + V)  # FOLD
        else:
            kv = self.kv_b_proj(cached).view(B, S, -1, NOPE + V).transpose(1, 2)
        k_nope, values = torch.split(kv, [NOPE, V], dim=-1)
        keys = kv.new_empty(B, H, S, NOPE + R)
        keys[..., :NOPE].copy_(k_nope)
        keys[..., NOPE:].copy_(self.rope_cache.expand(-1, H, -1, -1))
        if self.flaw == "slot bias":
            keys = keys + self.slot_bias  # SLOT-BIAS
        if self.flaw == "half":
            keys, values = keys[:, :, : S // 2], values[:, :, : S // 2]  # HALF
        visible = torch.arange(keys.shape[2])[None, None, None, :] <= positions[None, None, :, None]
        if not self.eager:
            return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=0.5)
        scores = torch.matmul(query, keys.transpose(2, 3)) * 0.5
        scores = scores + torch.where(visible, 0.0, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), values)


def inputs():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(B, H, T, NOPE + R, generator=gen), torch.randn(B, 1, T, C, generator=gen),
            torch.randn(B, 1, T, R, generator=gen), torch.arange(5, 5 + T))


def line_of(marker):
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line)


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
def test_an_expanded_latent_is_one_site_over_both_caches(eager):
    gm, _ = capture_graph(ExpandedLatent(eager=eager), *inputs())
    plan = find(gm)
    (site,) = plan.sites
    assert site.expanded is not None and site.latent is None and site.mask.proven and site.scale == 0.5
    names = sorted(w.cache.name for w in site.expanded.writes)
    assert len(names) == 2 and "latent_cache" in names[0] and "rope_cache" in names[1]
    ops = {str(n.target) for n in site.expanded.map.nodes}
    assert any("linear" in op for op in ops) and "new_empty" in ops and "copy_" in ops
    assert site.expanded.map.slots == S


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
def test_the_rewritten_site_computes_the_same_attention(eager):
    """A group of one: the prefix reads the map over the slots before the new tokens, the
    window replays the map on the new tokens alone (3 of them, where the cache has 16)."""
    gm, example = capture_graph(ExpandedLatent(eager=eager), *inputs())
    plan = find(gm)
    shard_attention(gm, plan, layout=KVLayout(1, 0, S), group_name=None)
    targets = [n.target for n in gm.graph.nodes]
    assert PREFIX_ATTENTION in targets and WINDOW_ATTENTION in targets
    assert not any("scaled_dot_product" in str(t) for t in targets)
    rewritten = gm(*example)
    rewritten = rewritten[0] if isinstance(rewritten, (tuple, list)) else rewritten
    torch.testing.assert_close(rewritten, ExpandedLatent(eager=eager)(*inputs()), rtol=1e-5, atol=1e-5)


def test_the_map_runs_over_the_cache_for_the_prefix_and_over_the_new_tokens_for_the_window():
    """The expansion is replayed on the 3 new tokens, not on a 16-slot copy of the cache:
    the replay's shape arguments (view, new_empty) hold the tokens where they held slots."""
    gm, example = capture_graph(ExpandedLatent(), *inputs())
    shard_attention(gm, find(gm), layout=KVLayout(1, 0, S), group_name=None)
    ShapeProp(gm).propagate(*example)
    expansions = [n for n in gm.graph.nodes if "linear" in str(n.target)]
    created = [n for n in gm.graph.nodes if n.target == "new_empty"]
    assert sorted(tuple(n.meta["tensor_meta"].shape) for n in expansions) == [(B, 1, T, H * (NOPE + V)),
                                                                             (B, 1, S, H * (NOPE + V))]
    assert sorted(tuple(n.meta["tensor_meta"].shape) for n in created) == [(B, H, T, NOPE + R), (B, H, S, NOPE + R)]


def test_two_ranks_get_one_collective_and_no_full_read():
    module = ExpandedLatent()
    gm, _ = capture_graph(module, *inputs())
    plan = find(gm)
    layout = KVLayout(2, 0, S)
    shard_kv_writes(gm, plan, layout=layout)
    shard_attention(gm, plan, layout=layout, group_name="g")
    check_target(gm, plan, size=2)
    assert sum(n.target is ALL_GATHER for n in gm.graph.nodes) == 1


FLAWS = [
    ("cumsum", "CUMSUM", r"read by 'cumsum' .*this op is not known to act slot by slot"),
    ("fold", "FOLD", r"read by 'view' .*reshapes \[2, 1, 16, 44\] to \[2, 4, 16, 11\], folding the batch or slot axis"),
    ("slot bias", "SLOT-BIAS", r"read by 'add' .*slot_bias.* varies along the slot axis"),
    ("half", "HALF", r"read by 'getitem' .*indexes the slot axis with slice\(None, 8, None\)"),
]


@pytest.mark.parametrize("flaw,marker,message", FLAWS, ids=[f for f, _, _ in FLAWS])
def test_a_map_that_mixes_slots_is_refused_with_its_line(flaw, marker, message):
    gm, _ = capture_graph(ExpandedLatent(flaw), *inputs())
    with pytest.raises(GraphPatternError, match=message) as error:
        find(gm)
    assert f"test_slotwise.py:{line_of(marker)}" in str(error.value)


class CacheThenInGraphAttention(nn.Module):
    """Hand-written attention over a cache (Hugging Face eager), then SDPA over tensors
    projected from its output: the second attention reads no cache's slots and is left
    alone, though its inputs descend from the first one's value cache."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(B, H, S, R))
        self.register_buffer("v_cache", torch.zeros(B, H, S, R))
        self.proj = nn.Linear(R, 2 * R, bias=False)

    def forward(self, query, latent, rope, positions):
        self.k_cache.index_copy_(2, positions, rope.expand(-1, H, -1, -1))
        self.v_cache.index_copy_(2, positions, rope.expand(-1, H, -1, -1))
        visible = torch.arange(S)[None, None, None, :] <= positions[None, None, :, None]
        scores = (query[..., :R] @ self.k_cache.transpose(-2, -1)).masked_fill(~visible, float("-inf"))
        out = scores.softmax(-1) @ self.v_cache
        k, v = self.proj(out).split(R, dim=-1)
        return F.scaled_dot_product_attention(out, k, v)


def test_attention_over_what_an_earlier_site_computed_is_left_alone():
    gm, _ = capture_graph(CacheThenInGraphAttention(), *inputs())
    plan = find(gm)
    (site,) = plan.sites
    assert site.expanded is None and "matmul" in str(site.node.target)


class InGraphSoftmaxProduct(CacheThenInGraphAttention):
    """After a cache attention, a softmax over another axis times an in-graph tensor (a
    router's weights, say): no attention over a cache, so none of its checks apply."""

    def forward(self, query, latent, rope, positions):
        out = super().forward(query, latent, rope, positions)
        weights = torch.softmax(out, dim=1)  # over the heads, not the keys
        return weights @ self.proj.weight[:R].T


def test_a_softmax_product_of_in_graph_tensors_is_not_read_as_attention():
    gm, _ = capture_graph(InGraphSoftmaxProduct(), *inputs())
    (site,) = find(gm).sites
    assert "matmul" in str(site.node.target)
