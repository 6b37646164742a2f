"""Exact log-sum-exp merge of partial attention results.

A partial attention over a key set ``K_i`` returns ``out_i = softmax(s_i) @ V_i`` and
``lse_i = log(sum(exp(s_i)))``.  Attention over the union of disjoint key sets is

    lse = logsumexp_i(lse_i)
    out = sum_i exp(lse_i - lse) * out_i

IEEE conventions, which every inserted merge relies on:
- a partial with no keys has ``lse = -inf``; its ``out`` is ignored, even if it is NaN;
- a ``+inf`` or NaN lse is treated as ``-inf`` (no keys), never propagated;
- merging only empty partials gives ``out = 0`` and ``lse = -inf``, with no NaN.
"""

from __future__ import annotations

import torch


def lse_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``N`` partials stacked on dim 0.

    Args:
        outs: ``[N, ..., D]`` partial outputs.
        lses: ``[N, ...]`` natural-log sums of exp, fp32.

    Returns:
        ``(out, lse)``: ``out`` is ``[..., D]`` in fp32, ``lse`` is ``[...]`` in fp32.
    """
    if outs.dim() != lses.dim() + 1 or outs.shape[:-1] != lses.shape:
        raise ValueError(
            f"lse_merge expects outs [N, ..., D] and lses [N, ...] with matching leading "
            f"dims; got outs {tuple(outs.shape)} and lses {tuple(lses.shape)}"
        )
    lses = lses.float()
    lses = torch.where(torch.isnan(lses) | (lses == float("inf")), float("-inf"), lses)
    lse_max = lses.amax(dim=0)
    # All partials empty: shift by 0 so exp(-inf - 0) = 0 instead of exp(nan).
    shift = torch.where(torch.isfinite(lse_max), lse_max, 0.0)
    weights = torch.exp(lses - shift)  # [N, ...]; exactly 0 for empty partials
    denom = weights.sum(dim=0)
    nonempty = denom > 0
    lse = torch.where(nonempty, shift + torch.log(torch.where(nonempty, denom, 1.0)), float("-inf"))
    # Zero the outputs of empty partials so that 0 * NaN garbage cannot leak in.
    outs = torch.where(weights.unsqueeze(-1) > 0, outs.float(), 0.0)
    out = (weights.unsqueeze(-1) * outs).sum(dim=0) / torch.where(nonempty, denom, 1.0).unsqueeze(-1)
    return out, lse
