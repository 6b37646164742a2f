"""Greedy decoding over a ``forward(tokens [B, T], positions [B, T]) -> logits`` callable.

Prompts of different lengths share one batch: the prefill is right-padded to the
longest prompt, and every later step feeds each sequence its own next position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class GreedyResult:
    tokens: torch.Tensor
    """``[B, steps + 1]``: the token after the prompt, then one per decode step."""
    logits: list[torch.Tensor]
    """Per step, ``[B, vocab]`` logits that chose that step's token (fp32, on CPU)."""


def pad_prompts(prompts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``tokens [B, T]``, ``positions [B, T]`` and prompt ``lengths [B]``."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
    positions = torch.arange(width).expand(len(prompts), width).contiguous()
    lengths = torch.tensor([len(p) for p in prompts])
    return tokens.to(device), positions.to(device), lengths.to(device)


@torch.no_grad()
def greedy_decode(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    device="cpu",
    on_token: Callable[[int, torch.Tensor], None] | None = None,
) -> GreedyResult:
    """Prefill ``prompts`` and decode ``steps`` more tokens per sequence."""
    tokens, positions, lengths = pad_prompts(prompts, device)
    rows = torch.arange(len(prompts), device=device)
    logits = forward(tokens, positions)[rows, lengths - 1]
    chosen, history = [logits.argmax(-1)], [logits.float().cpu()]
    if on_token is not None:
        on_token(0, chosen[-1])
    next_pos = lengths.clone()
    for step in range(steps):
        logits = forward(chosen[-1][:, None], next_pos[:, None])[:, 0]
        chosen.append(logits.argmax(-1))
        history.append(logits.float().cpu())
        next_pos = next_pos + 1
        if on_token is not None:
            on_token(step + 1, chosen[-1])
    return GreedyResult(torch.stack(chosen, dim=1).cpu(), history)
