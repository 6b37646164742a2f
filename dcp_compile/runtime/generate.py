"""Prompts into fixed-shape prefill chunks, and greedy decoding over a
``forward(tokens [B, T], positions [B, T]) -> logits`` callable.

A long prompt is fed in chunks of ``chunk_size`` tokens per row, every chunk the same
``[B, chunk_size]`` shape, so one compiled (and capturable) graph serves prompts of any
width for as long as the decoder runs.  Rows advance together: chunk ``c`` holds
positions ``c * chunk_size ...`` of every row.  A row whose prompt ends inside a chunk
(or before it) fills the rest with padding tokens at the positions after its prompt:
the causal mask hides them from the real tokens, nothing reads a slot past a row's
length before the row writes it again, and their positions are clamped below
``max_seq_len`` so that padding never asks for a slot the cache lacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

DEFAULT_CHUNK_SIZE = 2048
"""Prompt tokens per row and prefill step.  Measured on 2x H200 (BENCHMARKS.md, "Long
prompts"): a 32K prompt prefilled in chunks of 2048 and 4096 took 1.16x and 1.12x one
GPU's flash prefill, and 8 x 131,072-token prompts ran at 2048 in 88.7 GiB per rank;
larger chunks cost activation memory for every row of the batch."""


@dataclass
class GreedyResult:
    tokens: torch.Tensor
    """``[B, steps + 1]``: the token after the prompt, then one per decode step."""
    logits: list[torch.Tensor]
    """Per step, ``[B, vocab]`` logits that chose that step's token (fp32, on CPU)."""


@dataclass(frozen=True)
class PrefillChunk:
    tokens: torch.Tensor
    """``[B, C]`` prompt tokens at ``positions`` (0 past a row's prompt)."""
    positions: torch.Tensor
    """``[B, C]`` global positions, clamped below ``max_seq_len``."""
    next_tokens: torch.Tensor
    """``[B, C]`` the prompt token after each position (0 where the prompt has none:
    the caller puts the token it samples after the prompt at ``last``)."""
    last: torch.Tensor
    """``[B]`` index in the chunk of the row's last prompt token (clamped into the chunk)."""
    ends: torch.Tensor
    """``[B]`` bool: the row's prompt ends in this chunk."""


def check_chunk_size(chunk_size: int, max_seq_len: int) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size (prompt tokens per prefill step) must be an int >= 1, got {chunk_size!r}")
    if chunk_size > max_seq_len:
        raise ValueError(
            f"chunk_size={chunk_size} is larger than the cache (max_seq_len={max_seq_len}): a chunk's positions "
            f"must fit in the cache; use a chunk_size of at most {max_seq_len}"
        )


def prompt_lengths(prompts: Sequence[Sequence[int]]) -> list[int]:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    return [len(p) for p in prompts]


def prefill_chunks(
    prompts: Sequence[Sequence[int]], chunk_size: int, max_seq_len: int, device, *, offsets: torch.Tensor | None = None
) -> Iterator[PrefillChunk]:
    """The chunks that feed ``prompts`` (one row each) into a cache of ``max_seq_len``.
    ``offsets [B]``: a row's positions start there instead of at 0 (a running row that
    shares the chunk without being prefilled is moved past its committed tokens)."""
    check_chunk_size(chunk_size, max_seq_len)
    lengths_list = prompt_lengths(prompts)
    n_chunks = -(-max(lengths_list) // chunk_size)
    # One column past the last chunk, so every chunk's next_tokens is a plain slice.
    padded = torch.zeros(len(prompts), n_chunks * chunk_size + 1, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        padded[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
    padded = padded.to(device)
    lengths = torch.tensor(lengths_list, device=device)
    steps = torch.arange(chunk_size, device=device)
    for c in range(n_chunks):
        start = c * chunk_size
        positions = (start + steps).expand(len(prompts), chunk_size)
        if offsets is not None:
            positions = positions + offsets[:, None]
        positions = positions.clamp(max=max_seq_len - 1).contiguous()
        yield PrefillChunk(
            # Contiguous: a slice's row stride would follow the prompt width, and a
            # compiled graph guards on strides.
            tokens=padded[:, start : start + chunk_size].contiguous(),
            positions=positions,
            next_tokens=padded[:, start + 1 : start + chunk_size + 1].contiguous(),
            last=(lengths - 1 - start).clamp(0, chunk_size - 1),
            ends=(lengths - 1 >= start) & (lengths - 1 < start + chunk_size),
        )


def tokens_prefilled(length: int, chunk_size: int, max_chunks: int | None) -> int:
    """How many of ``length`` prompt tokens a prefill of at most ``max_chunks`` chunks
    (``None``: all of them) feeds."""
    return length if max_chunks is None else min(length, max_chunks * chunk_size)


def pad_prompts(prompts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``tokens [B, T]``, ``positions [B, T]`` and prompt ``lengths [B]``."""
    lengths = prompt_lengths(prompts)
    width = max(lengths)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
    positions = torch.arange(width).expand(len(prompts), width).contiguous()
    return tokens.to(device), positions.to(device), torch.tensor(lengths).to(device)


@torch.no_grad()
def greedy_decode(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    device="cpu",
    on_token: Callable[[int, torch.Tensor], None] | None = None,
    chunk_size: int | None = None,
    max_seq_len: int | None = None,
) -> GreedyResult:
    """Prefill ``prompts`` and decode ``steps`` more tokens per sequence.

    ``chunk_size`` (with the cache's ``max_seq_len``): prefill in ``[B, chunk_size]``
    chunks, one shape for every prompt width, so a compiled ``forward`` compiles its
    prefill once.  ``None``: one prefill call as wide as the longest prompt.
    """
    if chunk_size is None:
        tokens, positions, lengths = pad_prompts(prompts, device)
        rows = torch.arange(len(prompts), device=device)
        logits = forward(tokens, positions)[rows, lengths - 1]
    else:
        if max_seq_len is None:
            raise ValueError("greedy_decode(chunk_size=...) needs the cache's max_seq_len, to keep padding in the cache")
        rows = torch.arange(len(prompts), device=device)
        logits = None
        for chunk in prefill_chunks(prompts, chunk_size, max_seq_len, device):
            chunk_logits = forward(chunk.tokens, chunk.positions)[rows, chunk.last]
            logits = chunk_logits if logits is None else torch.where(chunk.ends[:, None], chunk_logits, logits)
        lengths = torch.tensor(prompt_lengths(prompts), device=device)
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
