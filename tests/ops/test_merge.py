import pytest
import torch

from dcp_compile.ops import lse_merge

INF = float("inf")


def merge_float64(outs, lses):
    """Independent reference: softmax weights over partials, in float64."""
    lses, outs = lses.double(), outs.double()
    lse = torch.logsumexp(lses, dim=0)
    return (torch.exp(lses - lse).unsqueeze(-1) * outs).sum(0), lse


def random_partials(n=4, shape=(3, 5), d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, d, generator=gen), 3 * torch.randn(n, *shape, generator=gen)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_merge_matches_float64(n):
    outs, lses = random_partials(n)
    out, lse = lse_merge(outs, lses)
    ref_out, ref_lse = merge_float64(outs, lses)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


def test_empty_partials_are_ignored_even_with_garbage_outputs():
    outs, lses = random_partials(3)
    outs[1], lses[1] = float("nan"), -INF  # an empty partial: its out is garbage
    out, lse = lse_merge(outs, lses)
    ref_out, ref_lse = merge_float64(outs[[0, 2]], lses[[0, 2]])
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [INF, float("nan")])
def test_inf_and_nan_lse_count_as_empty(bad):
    outs, lses = random_partials(3)
    lses[2, 0, 0] = bad
    outs[2, 0, 0] = 1e30
    out, lse = lse_merge(outs, lses)
    ref_out, ref_lse = merge_float64(outs[:2], lses[:2])
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out[0, 0].double(), ref_out[0, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[0, 0].double(), ref_lse[0, 0], rtol=1e-6, atol=1e-6)


def test_all_empty_rows_give_zero_and_minus_inf_without_nan():
    outs, lses = random_partials(4)
    lses[:, 1] = -INF
    lses[0, 2, 3], lses[1, 2, 3], lses[2, 2, 3], lses[3, 2, 3] = float("nan"), INF, -INF, float("nan")
    outs[:, 1] = float("nan")
    out, lse = lse_merge(outs, lses)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[1] == 0).all() and (lse[1] == -INF).all()
    assert (out[2, 3] == 0).all() and lse[2, 3] == -INF
    assert torch.isfinite(lse[0]).all()


def test_merge_is_associative():
    outs, lses = random_partials(3, seed=3)
    lses[1, 0] = -INF  # mix in an empty partial
    ab_out, ab_lse = lse_merge(outs[:2], lses[:2])
    bc_out, bc_lse = lse_merge(outs[1:], lses[1:])
    left = lse_merge(torch.stack([ab_out, outs[2]]), torch.stack([ab_lse, lses[2]]))
    right = lse_merge(torch.stack([outs[0], bc_out]), torch.stack([lses[0], bc_lse]))
    flat = lse_merge(outs, lses)
    for a, b in ((left, right), (left, flat)):
        torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-6)


def test_merge_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="outs \\[N, ..., D\\] and lses \\[N, ...\\]"):
        lse_merge(torch.zeros(2, 3, 4), torch.zeros(3, 3))


@pytest.mark.parametrize("n", [1, 2, 5])
def test_merge_with_window_is_lse_merge_of_all(n):
    """The inserted form (partials in place, the window apart) against the stacked spec,
    with empty, NaN and +inf partials among them."""
    from dcp_compile.ops.merge import merge_with_window

    outs, lses = random_partials(n + 1, seed=n)
    lses[0, 0, :2] = -INF
    outs[0, 0, :2] = float("nan")  # garbage of an empty partial
    lses[-1, 1, 1] = float("nan")
    lses[:, 2, 3] = -INF  # every partial empty, window included
    if n > 1:
        lses[1, 2, 0] = INF
    expected, _ = lse_merge(outs, lses)
    got = merge_with_window(outs[:-1], lses[:-1], outs[-1], lses[-1])
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert (got[2, 3] == 0).all()
