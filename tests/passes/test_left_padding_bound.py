"""The left-padding bound: the prover proves ``slots >= lo[b]`` (a per-row lower bound,
in the forms code builds it, transformers' gathered read included) and the cascade hands
it to the length-bounded ops; a padding mask that is a table, whatever its data, keeps
the masked reference, and every other extra condition is refused."""

import pytest
import torch
import torch.nn.functional as F

from dcp_compile.layout import KVLayout
from dcp_compile.ops.attention import attention_with_lse
from dcp_compile.passes import GraphPatternError, find, shard_attention
from dcp_compile.passes.check import count_targets
from dcp_compile.passes.shard_attention import PREFIX_ATTENTION, WINDOW_ATTENTION
from tests.passes import graphs
from tests.passes.test_causal_mask import causal, hf_gather
from tests.support import capture_graph


class Bounded(graphs.GptFastStyle):
    """Causal AND ``keep(slots, lo)`` with ``lo [B]`` a graph input (``keep`` may also read
    a 2-D mask table ``table [B, S]``)."""

    def __init__(self, keep):
        super().__init__()
        self.keep = keep

    def forward(self, x, input_pos, lo, table):
        q, _, _ = self.store(x, input_pos)
        slots = torch.arange(graphs.S)
        mask = causal(slots, input_pos) & self.keep(slots, lo, table)  # THE-MASK
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)


def at_least(slots, lo):
    return slots[None, :] >= lo[:, None]


BOUNDS = {
    # keep(slots, lo, table) -> the bound's constant
    "broadcast": (lambda s, lo, t: at_least(s, lo)[:, None, None, :], 0),
    "transformers' gathered read": (lambda s, lo, t: hf_gather(at_least(s, lo)), 0),
    "strict, past the pads": (lambda s, lo, t: (s[None, :] > lo[:, None])[:, None, None, :], 1),
    "not below": (lambda s, lo, t: ~(s[None, :] < lo[:, None])[:, None, None, :], 0),
}
NOT_BOUNDS = {
    # zeros that are a suffix of the row: an upper bound, not left padding
    "upper bound": (lambda s, lo, t: (s[None, :] < lo[:, None])[:, None, None, :], "restricts the causal mask"),
    # a bound that moves with the token is a sliding window
    "per-token bound": (
        lambda s, lo, t: (s[None, None, :] >= lo[:, None, None] + torch.arange(3)[None, :, None])[:, None],
        "restricts the causal mask"),
    "union with a table": (lambda s, lo, t: at_least(s, lo)[:, None, None, :] | t[:, None, None, :], "or_"),
    # right-padded with False: the slots past the narrower mask are hidden too
    "bound, right-padded": (lambda s, lo, t: F.pad(at_least(torch.arange(graphs.S - 4), lo), (0, 4))[:, None, None, :],
                            "restricts the causal mask"),
}


def inputs(module, *, lo=(2, 5), table=None):
    x, pos = graphs.inputs_for(module)
    keep = torch.ones(graphs.B, graphs.S, dtype=torch.bool) if table is None else table
    return x, pos, torch.tensor(lo), keep


def rewritten(module, *args, size=2):
    gm, real = capture_graph(module, *args)
    plan = find(gm)
    shard_attention(gm, plan, layout=KVLayout(size, 0, graphs.S), group_name="g" if size > 1 else None)
    return gm, plan, real


@pytest.mark.parametrize("name", BOUNDS)
def test_lower_bounds_are_proven_and_run_the_length_bounded_ops(name):
    keep, const = BOUNDS[name]
    module = Bounded(keep)
    gm, plan, _ = rewritten(module, *inputs(module))
    proof = plan.sites[0].mask
    assert proof.proven, proof.failure
    assert not proof.key_masks
    ((bound_input, coef),) = proof.key_lower_bounds[0].inputs
    assert "lo" in bound_input.name and coef == 1 and proof.key_lower_bounds[0].const == const
    counts = count_targets(gm)
    assert counts[PREFIX_ATTENTION] == counts[WINDOW_ATTENTION] == 1 and counts[attention_with_lse] == 0
    prefix = next(n for n in gm.graph.nodes if n.target is PREFIX_ATTENTION)
    window = next(n for n in gm.graph.nodes if n.target is WINDOW_ATTENTION)
    assert len(prefix.args) == 6 and prefix.args[5] is not None, "the prefix takes the bound's first local slot"
    assert len(window.args) == 6 and window.args[5] is not None, "the window takes the bound"


def test_a_table_whose_zeros_are_not_a_prefix_keeps_the_masked_reference():
    """A 2-D padding mask table is never run as a bound, whatever it holds: here its
    zeros sit in the middle of the rows, which a bound would get wrong."""
    module = Bounded(lambda s, lo, t: t[:, None, None, :])
    table = torch.ones(graphs.B, graphs.S, dtype=torch.bool)
    table[:, 3:6] = False
    gm, plan, _ = rewritten(module, *inputs(module, table=table))
    proof = plan.sites[0].mask
    assert proof.proven and proof.key_masks and not proof.key_lower_bounds
    counts = count_targets(gm)
    assert counts[attention_with_lse] == 2 and counts[PREFIX_ATTENTION] == counts[WINDOW_ATTENTION] == 0


def test_a_bound_and_a_table_together_keep_the_masked_reference_with_both():
    module = Bounded(lambda s, lo, t: at_least(s, lo)[:, None, None, :] & t[:, None, None, :])
    gm, plan, _ = rewritten(module, *inputs(module))
    proof = plan.sites[0].mask
    assert proof.key_masks and proof.key_lower_bounds
    assert count_targets(gm)[attention_with_lse] == 2


@pytest.mark.parametrize("name", NOT_BOUNDS)
def test_other_conditions_are_refused(name):
    keep, expected = NOT_BOUNDS[name]
    module = Bounded(keep)
    gm, real = capture_graph(module, *inputs(module))
    plan = find(gm)
    assert not plan.sites[0].mask.proven
    before = gm.code
    with pytest.raises(GraphPatternError, match=expected) as error:
        shard_attention(gm, plan, layout=KVLayout(2, 0, graphs.S), group_name="g")
    assert "test_left_padding_bound.py" in str(error.value), "the error names the user's source line"
    assert gm.code == before


@pytest.mark.parametrize("name", ["broadcast", "transformers' gathered read", "strict, past the pads"])
def test_the_rewritten_graph_computes_the_users_attention(name):
    """A group of one (the single-GPU cascade) runs the bound through the ops and gives
    the user's own masked attention, rows of only padding included (``lo`` past every
    position: out 0, where SDPA over a fully masked row gives 0 too)."""
    keep, _ = BOUNDS[name]
    module = Bounded(keep)
    args = inputs(module, lo=(1, 9))
    expected = Bounded(keep)
    expected.load_state_dict(module.state_dict())
    with torch.no_grad():
        want = expected(*args)
        gm, _, real = rewritten(module, *args, size=1)
        got = gm(*real)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
