"""MLA's absorbed attention (DeepSeek's decode form) over latent caches: found, rewritten,
or refused with the user's line."""

import pytest
import torch
from torch import nn

from dcp_compile.layout import KVLayout
from dcp_compile.models.mla import MLAConfig, MLATransformer
from dcp_compile.passes import GraphPatternError, find, shard_attention
from dcp_compile.passes.shard_attention import ALL_GATHER, LATENT_PREFIX_ATTENTION
from tests.support import capture_graph

B, S, T, H, C, R = 2, 16, 3, 4, 8, 4


class Latent(nn.Module):
    """``flaw`` breaks one thing the passes rely on."""

    def __init__(self, flaw=None, heads_first=False):
        super().__init__()
        self.flaw, self.heads_first = flaw, heads_first
        self.register_buffer("kv_cache", torch.zeros(B, S, C))
        self.register_buffer("pe_cache", torch.zeros(B, S, R))
        self.register_buffer("other", torch.zeros(B, S, C))

    def forward(self, q_lat, q_pe, c_kv, k_pe, positions):
        rows = torch.arange(B)[:, None]
        self.kv_cache[rows, positions] = c_kv
        if self.flaw != "unwritten rope":
            self.pe_cache[rows, positions] = k_pe
        if self.heads_first:  # [B, H, T, .] queries, scores [B, H, T, S]
            scores = (torch.einsum("bhtc,bsc->bhts", q_lat.transpose(1, 2), self.kv_cache)
                      + torch.einsum("bhtr,bsr->bhts", q_pe.transpose(1, 2), self.pe_cache)) * 0.5
            visible = torch.arange(S)[None, None, None, :] <= positions[:, None, :, None]
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            return torch.einsum("bhts,bsc->bhtc", probs, self.kv_cache).transpose(1, 2)
        scores = (torch.einsum("bthc,bsc->bths", q_lat, self.kv_cache)  # SCORES
                  + torch.einsum("bthr,bsr->bths", q_pe, self.pe_cache)) * 0.5
        slots = torch.arange(S)
        visible = slots[None, None, None, :] <= positions[:, :, None, None]
        if self.flaw == "window":
            visible = visible & (slots[None, None, None, :] > positions[:, :, None, None] - 4)  # WINDOW
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=1 if self.flaw == "axis" else -1)  # SOFTMAX
        values = self.other if self.flaw == "values" else self.kv_cache
        return torch.einsum("bths,bsc->bthc", probs, values)


def inputs():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(B, T, H, C, generator=gen), torch.randn(B, T, H, R, generator=gen),
            torch.randn(B, T, C, generator=gen), torch.randn(B, T, R, generator=gen),
            torch.arange(5, 5 + T).expand(B, T).contiguous())


def line_of(marker):
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line)


def test_the_absorbed_form_is_one_latent_site_and_is_rewritten():
    gm, _ = capture_graph(Latent(), *inputs())
    plan = find(gm)
    (site,) = plan.sites
    assert site.latent is not None and site.mask.proven and site.scale == 0.5
    assert site.k_write is site.v_write and "kv_cache" in site.k_write.cache.name
    assert "pe_cache" in site.latent.rope_write.cache.name
    assert site.latent.query_perm == (0, 2, 1, 3)  # [B, T, H, C] -> [B, H, T, C]
    einsums = lambda: sum(1 for n in gm.graph.nodes if n.target is torch.functional.einsum or "einsum" in str(n.target))  # noqa: E731
    assert einsums() == 3
    shard_attention(gm, plan, layout=KVLayout(2, 0, S), group_name="g")
    assert einsums() == 0
    assert sum(n.target is ALL_GATHER for n in gm.graph.nodes) == 1
    assert sum(n.target is LATENT_PREFIX_ATTENTION for n in gm.graph.nodes) == 1


def test_the_reference_mla_target_has_one_latent_site_per_layer():
    cfg = MLAConfig(n_layers=3)
    model = MLATransformer(cfg)
    tokens = torch.zeros(cfg.max_batch, 2, dtype=torch.long)
    gm, _ = capture_graph(model, tokens, torch.arange(2).expand(cfg.max_batch, 2).contiguous())
    plan = find(gm)
    assert len(plan.sites) == 3 and all(s.latent is not None and s.mask.proven for s in plan.sites)
    assert len(plan.caches) == 6


@pytest.mark.parametrize("flaw, marker, message", [
    ("unwritten rope", "SCORES", r"not a sum of einsum\(\"bthc,bsc->bths\", query, cache\) terms"),
    ("axis", "SOFTMAX", "runs over axis 1, not over the keys"),
    ("values", "SCORES", "a KV cache is read by 'einsum'"),
])
def test_latent_attention_the_passes_cannot_read_is_refused(flaw, marker, message):
    gm, _ = capture_graph(Latent(flaw), *inputs())
    with pytest.raises(GraphPatternError, match=message) as error:
        find(gm)
    assert f"test_latent.py:{line_of(marker)}" in str(error.value)


def test_a_latent_attention_under_a_window_mask_is_not_sharded():
    gm, _ = capture_graph(Latent("window"), *inputs())
    plan = find(gm)
    (site,) = plan.sites
    assert not site.mask.proven and "restricts the causal mask further" in site.mask.failure
    with pytest.raises(GraphPatternError, match="restricts the causal mask further"):
        shard_attention(gm, plan, layout=KVLayout(2, 0, S), group_name="g")


class LatentSDPA(nn.Module):
    """The same attention spelled with SDPA: keys [latent | rope] 12 wide, values the latent."""

    def __init__(self):
        super().__init__()
        self.register_buffer("kv_cache", torch.zeros(B, S, C))
        self.register_buffer("pe_cache", torch.zeros(B, S, R))

    def forward(self, q_lat, q_pe, c_kv, k_pe, positions):
        rows = torch.arange(B)[:, None]
        self.kv_cache[rows, positions] = c_kv
        self.pe_cache[rows, positions] = k_pe
        slots = torch.arange(S)
        visible = slots[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
        q = torch.cat([q_lat, q_pe], dim=-1).transpose(1, 2)  # [B, H, T, C + R]
        keys = torch.cat([self.kv_cache, self.pe_cache], dim=-1)[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, self.kv_cache[:, None], attn_mask=visible,
                                                               scale=0.5, enable_gqa=True)
        return out.transpose(1, 2)


def test_the_sdpa_spelling_is_a_latent_site_with_the_same_result():
    module = LatentSDPA()
    gm, example = capture_graph(module, *inputs())
    plan = find(gm)
    (site,) = plan.sites
    assert site.latent is not None and site.latent.rope_query is None and site.mask.proven and site.scale == 0.5
    shard_attention(gm, plan, layout=KVLayout(1, 0, S), group_name=None)
    assert not any("scaled_dot_product" in str(n.target) for n in gm.graph.nodes)
    # the two spellings are one function, and the rewritten graph (a group of one) computes it
    sdpa, einsum = LatentSDPA()(*inputs()), Latent()(*inputs())
    torch.testing.assert_close(sdpa, einsum, rtol=1e-5, atol=1e-5)
    rewritten = gm(*example)
    rewritten = rewritten[0] if isinstance(rewritten, (tuple, list)) else rewritten
    torch.testing.assert_close(rewritten, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads_first", [False, True])
def test_the_rewritten_latent_site_computes_the_same_attention(heads_first):
    """A group of one runs the cascade without a collective: the same numbers as the
    user's einsums, whichever of the token and head axes comes first."""
    gm, example = capture_graph(Latent(heads_first=heads_first), *inputs())
    plan = find(gm)
    (site,) = plan.sites
    assert site.mask.proven and site.latent.query_perm == ((0, 1, 2, 3) if heads_first else (0, 2, 1, 3))
    shard_attention(gm, plan, layout=KVLayout(1, 0, S), group_name=None)
    rewritten = gm(*example)
    rewritten = rewritten[0] if isinstance(rewritten, (tuple, list)) else rewritten
    torch.testing.assert_close(rewritten, Latent(heads_first=heads_first)(*inputs()), rtol=1e-5, atol=1e-5)
