"""The mask prover: the masks serving code builds are proven position-causal; every
other mask over a cache is refused with the line that built it."""

import pytest
import torch
import torch.nn.functional as F

from dcp_compile.layout import KVLayout
from dcp_compile.models import LlamaConfig
from dcp_compile.models.llama import GQA_FORMS
from dcp_compile.passes import GraphPatternError, find, shard_attention
from dcp_compile.runtime.prepare import is_lower_triangular
from tests.support import capture_graph, make_model
from tests.passes import graphs


def proofs(module, *inputs):
    gm, real = capture_graph(module, *(inputs or graphs.inputs_for(module)))
    plan = find(gm)
    return gm, plan, real


@pytest.mark.parametrize("module_cls", [graphs.GptFastStyle, graphs.IndexCopyStyle, graphs.IndexPutBSHD])
def test_idioms_are_proven(module_cls):
    module = module_cls()
    _, plan, real = proofs(module)
    assert all(site.mask.proven for site in plan.sites)
    tables = [real[i] for i in plan.mask_inputs]
    assert tables == ([module.causal_mask] if module_cls is graphs.GptFastStyle else [])


@pytest.mark.parametrize("gqa", GQA_FORMS)
def test_reference_model_masks_are_proven(gqa):
    cfg = LlamaConfig(gqa=gqa)
    tokens = torch.zeros(cfg.max_batch, 2, dtype=torch.long)
    _, plan, _ = proofs(make_model(cfg), tokens, tokens.clone())
    assert len(plan.sites) == cfg.n_layers and all(s.mask.proven for s in plan.sites)


class MaskedBy(graphs.GptFastStyle):
    """gpt-fast writes, then attention with the mask ``build(slots [S], input_pos [T])``."""

    def __init__(self, build, **sdpa):
        super().__init__()
        self.build, self.sdpa = build, sdpa

    def forward(self, x, input_pos):
        q, _, _ = self.store(x, input_pos)
        slots = torch.arange(graphs.S)
        mask = self.build(slots, input_pos)
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True, **self.sdpa)


def causal(s, p):
    return (s[None, :] <= p[:, None])[None, None]


PROVEN = {
    "le": causal,
    "ge swapped": lambda s, p: p[:, None] >= s[None, :],
    "lt plus one": lambda s, p: s[None, :] < p[:, None] + 1,
    "not gt": lambda s, p: ~(s[None, :] > p[:, None]),
    "and with all-true": lambda s, p: p.new_ones((), dtype=torch.bool) & causal(s, p),
    "additive": lambda s, p: torch.where(causal(s, p), 0.0, float("-inf")),
    # transformers' eager masks: a zero scalar tensor kept, the dtype's minimum dropped
    "additive, transformers 5.24": lambda s, p: torch.where(
        causal(s, p), torch.zeros((), dtype=torch.float32), torch.finfo(torch.float32).min),
    "additive, transformers 5.17": lambda s, p: torch.where(
        causal(s, p), torch.tensor(0.0, dtype=torch.float32), torch.finfo(torch.float32).min),
}

REFUSED = {
    "sliding window": (lambda s, p: causal(s, p) & (s[None, :] > p[:, None] - 4)[None, None], "restricts the causal mask"),
    "off by one": (lambda s, p: s[None, :] <= p[:, None] + 1, "is not the position-causal mask"),
    "union": (lambda s, p: causal(s, p) | (s[None, :] == 0), "or_"),
    "slot-aligned tril": (lambda s, p: torch.ones(p.shape[0], graphs.S, dtype=torch.bool).tril(), "ones"),
    "no mask": (lambda s, p: None, "has no mask"),
    "additive, keeps a bias": (lambda s, p: torch.where(causal(s, p), torch.tensor(0.5), torch.finfo(torch.float32).min),
                               "torch.where other than where"),
}


@pytest.mark.parametrize("name", PROVEN)
def test_equivalent_forms_are_proven(name):
    _, plan, _ = proofs(MaskedBy(PROVEN[name]))
    assert plan.sites[0].mask.proven, plan.sites[0].mask.failure


@pytest.mark.parametrize("name", REFUSED)
def test_other_masks_are_refused_when_sharding(name):
    build, expected = REFUSED[name]
    gm, plan, _ = proofs(MaskedBy(build))
    assert not plan.sites[0].mask.proven
    before = gm.code
    with pytest.raises(GraphPatternError, match=expected) as error:
        shard_attention(gm, plan, layout=KVLayout(2, 0, graphs.S), group_name="g")
    assert "test_causal_mask.py" in str(error.value), "the error names the user's source line"
    assert gm.code == before, "nothing is rewritten when a mask is refused"


def test_is_causal_is_refused():
    _, plan, _ = proofs(MaskedBy(lambda s, p: None, is_causal=True))
    assert "is_causal=True" in plan.sites[0].mask.failure


class PaddedCausal(graphs.GptFastStyle):
    """Causal AND a key-padding mask ``keep [B, W]`` over global positions, read as ``read(keep)``."""

    def __init__(self, read):
        super().__init__()
        self.read = read

    def forward(self, x, input_pos, keep):
        q, _, _ = self.store(x, input_pos)
        mask = causal(torch.arange(graphs.S), input_pos) & self.read(keep)  # PADDING-MASK
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)


def hf_gather(keep):
    """Transformers' ``padding_mask_function``: ``keep[batch_idx, kv_idx]`` over broadcast aranges."""
    keep = F.pad(keep.to(torch.bool), (0, graphs.S - keep.shape[1]))
    return keep[torch.arange(graphs.B)[:, None, None, None], torch.arange(graphs.S)[None, None, None, :]]


KEY_MASKS = {
    "broadcast bool": (lambda keep: keep[:, None, None, :], torch.bool, graphs.S),
    "integer, != 0": (lambda keep: keep.bool()[:, None, None, :], torch.long, graphs.S),
    "gathered, right-padded": (hf_gather, torch.long, graphs.S - 5),
}


@pytest.mark.parametrize("name", KEY_MASKS)
def test_padding_masks_are_proven_as_key_masks(name):
    read, dtype, width = KEY_MASKS[name]
    module = PaddedCausal(read)
    x, pos = graphs.inputs_for(module)
    keep = torch.ones(graphs.B, width, dtype=dtype)
    _, plan, _ = proofs(module, x, pos, keep)
    mask = plan.sites[0].mask
    assert mask.proven, mask.failure
    assert [n.op for n in mask.key_masks] == ["placeholder"] and "keep" in mask.key_masks[0].name


def test_padding_mask_read_along_the_queries_is_refused():
    module = PaddedCausal(lambda keep: keep[:, None, :, None])  # keep [B, T]: a query mask, not a key mask
    x, pos = graphs.inputs_for(module)
    gm, plan, _ = proofs(module, x, pos, torch.ones(graphs.B, x.shape[1], dtype=torch.bool))
    failure = plan.sites[0].mask.failure
    assert "reads the padding mask" in failure and "only when read at [b, s]" in failure
    assert "PADDING-MASK" in failure or "test_causal_mask.py" in failure, "the error names the user's line"


def test_drafts_and_groups_of_one_do_not_need_a_proof():
    """find never raises for an unproven mask: only sharding does."""
    gm, plan, _ = proofs(MaskedBy(REFUSED["sliding window"][0]))
    assert len(plan.sites) == 1


def test_lower_triangular_tables():
    tril = torch.tril(torch.ones(9, 9, dtype=torch.bool))
    assert is_lower_triangular(tril, rows_per_block=4)
    assert is_lower_triangular(torch.where(tril, 0.0, float("-inf")))
    assert not is_lower_triangular(torch.ones(9, 9, dtype=torch.bool).tril(-1))
    banded = tril & ~torch.tril(torch.ones(9, 9, dtype=torch.bool), -3)
    assert not is_lower_triangular(banded, rows_per_block=4)
