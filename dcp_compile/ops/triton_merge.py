"""The second kernel of a split-KV launch: each row's slices merged exactly by their LSE
weights (the algebra of ``lse_merge``).  Shared by the GQA prefix kernels
(``triton_prefix``, ``triton_paged``) and MLA's latent kernels."""

from __future__ import annotations

import triton
import triton.language as tl
from torch.library import wrap_triton


@triton.jit
def _split_weights(LSE_PART, row, num_splits, SPLITS: tl.constexpr):
    """A row's slices' weights ``exp(lse - shift)`` ([SPLITS], 0 past ``num_splits``), the
    shift (their largest lse) and the weights' sum; the lses are ``[rows, num_splits]``."""
    offs_n = tl.arange(0, SPLITS)
    lse = tl.load(LSE_PART + row * num_splits + offs_n, mask=offs_n < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # No split saw a key: shift by 0 so every weight is exp(-inf) = 0, not exp(NaN).
    shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp(lse - shift)
    return w, shift, tl.sum(w, 0)


@triton.jit
def _store_merged(O, LSE, row, offs_d, weighted, shift, total, D: tl.constexpr):
    """A row's merged output (``weighted``: the slices' outputs summed by weight) and lse;
    a row no slice saw gets 0 and -inf."""
    seen = total > 0.0
    total_safe = tl.where(seen, total, 1.0)
    tl.store(O + row * D + offs_d, weighted / total_safe)
    tl.store(LSE + row, tl.where(seen, shift + tl.log(total_safe), float("-inf")))


@triton.jit
def _merge_splits_kernel(
    O_PART, LSE_PART, O, LSE, num_splits,
    D: tl.constexpr, SPLITS: tl.constexpr,
):
    # One program per (b, h, t) row; partials are contiguous [rows, num_splits, (D)].
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    w, shift, total = _split_weights(LSE_PART, row, num_splits, SPLITS)
    o = tl.load(
        O_PART + row * num_splits * D + offs_n[:, None] * D + offs_d[None, :], mask=(offs_n < num_splits)[:, None],
        other=0.0,
    )
    _store_merged(O, LSE, row, offs_d, tl.sum(w[:, None] * o, 0), shift, total, D)


def _merge_splits(o_part, lse_part, out, lse, num_splits: int) -> None:
    if num_splits > 1:
        B, H, T, width = (int(n) for n in out.shape)
        wrap_triton(_merge_splits_kernel)[(B * H * T,)](
            o_part, lse_part, out, lse, num_splits, D=width, SPLITS=triton.next_power_of_2(num_splits),
            num_warps=4 if num_splits <= 64 else 8,
        )
