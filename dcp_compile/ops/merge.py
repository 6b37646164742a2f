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
    lses = _no_keys_as_minus_inf(lses)
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


def _no_keys_as_minus_inf(lse: torch.Tensor) -> torch.Tensor:
    lse = lse.float()
    return torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)


def merge_with_window(
    outs: torch.Tensor, lses: torch.Tensor, window_out: torch.Tensor, window_lse: torch.Tensor
) -> torch.Tensor:
    """``lse_merge`` of ``N`` stacked partials and one more (the window), returning ``out``
    only, without stacking the window onto the partials: the gathered payload is read in
    place and the whole merge is one pointwise-and-reduce expression that Inductor emits
    as a single kernel (a stack or a cat would be a copy of every partial first)."""
    lses, window_lse = _no_keys_as_minus_inf(lses), _no_keys_as_minus_inf(window_lse)
    lse_max = torch.maximum(lses.amax(dim=0), window_lse)
    shift = torch.where(torch.isfinite(lse_max), lse_max, 0.0)
    weights = torch.exp(lses - shift)  # [N, ...]; exactly 0 for empty partials
    window_weight = torch.exp(window_lse - shift)
    denom = weights.sum(dim=0) + window_weight
    total = (weights.unsqueeze(-1) * torch.where(weights.unsqueeze(-1) > 0, outs.float(), 0.0)).sum(dim=0)
    total = total + window_weight.unsqueeze(-1) * torch.where(window_weight.unsqueeze(-1) > 0, window_out.float(), 0.0)
    return total / torch.where(denom > 0, denom, 1.0).unsqueeze(-1)
