"""The batch on the device between speculative steps, and how a step moves it on.

A step ends every row's turn on the device: it moves each row still generating past the
tokens it emitted, and ends the rows that emitted a stop token or spent their budget
(``finish_and_advance``).  The host then needs nothing from a step before it launches
the next one: it reads a step's tokens while the next step runs (``engine.SpecEngine``),
and a row that ended there takes part in that next step as an inactive row (no accepted
tokens, nothing committed, its length unchanged), which costs nothing but its share of
the static shapes.  The host and the device take the same decision from the same tokens;
the engine checks that they did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class StepState:
    """The batch on the device between steps."""

    length: torch.Tensor
    """``[B]`` committed target tokens; ``current`` sits at position ``length``."""
    current: torch.Tensor
    """``[B]`` the last emitted token, not yet in the target's cache."""
    q_logits: torch.Tensor | None
    """``[B, V_draft]`` the draft's logits for the next draft token (``None``: no draft)."""
    hidden: torch.Tensor | None
    """``[B, 1, H]`` the draft's hidden state they came with."""
    active: torch.Tensor
    """``[B]`` bool: rows still generating."""
    temperature: torch.Tensor
    """``[B]`` each row's sampling temperature (0: greedy)."""
    sampling: bool
    """Whether any row samples (the host knows; all-greedy steps skip the sampler)."""
    remaining: torch.Tensor
    """``[B]`` tokens each row may still emit; a row that reaches it ends."""
    stops: torch.Tensor
    """``[B, S]`` token ids that end each row (``-1``: no id)."""


STOP_IDS_PER_ROW = 8
"""The stop ids a row's state holds (an engine's ``stop_ids`` and the request's own
``eos_id``), unused ones -1: one width for every engine over a decoder, so that their
states fit the step it captured."""


def idle_state(batch: int, device, *,
               stops: int = STOP_IDS_PER_ROW) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``active``, ``remaining`` and ``stops`` of a batch with no row started."""
    return (torch.zeros(batch, dtype=torch.bool, device=device), torch.zeros(batch, dtype=torch.long, device=device),
            torch.full((batch, stops), -1, dtype=torch.long, device=device))


def start_rows(state: StepState, rows: Sequence[int], remaining: Sequence[int], stops: Sequence[Sequence[int]]) -> None:
    """Start ``rows`` generating: each may emit ``remaining`` more tokens and ends at any of
    its ``stops`` (at most ``state.stops.shape[1]`` ids).  Writes those rows alone, in
    place, after whatever the device has queued: a step in flight keeps its own view."""
    if not rows:
        return
    width = state.stops.shape[1]
    if any(len(s) > width for s in stops):
        raise ValueError(f"a row ends at up to {width} stop ids here, got {max(len(s) for s in stops)}")
    device = state.active.device
    index = torch.tensor(list(rows), device=device)
    table = torch.tensor([list(s) + [-1] * (width - len(s)) for s in stops], dtype=torch.long, device=device)
    state.active[index] = True
    state.remaining[index] = torch.tensor(list(remaining), dtype=torch.long, device=device)
    state.stops[index] = table


def stop_rows(state: StepState, rows: Sequence[int]) -> None:
    """End ``rows`` (aborted), in place, after whatever the device has queued."""
    if rows:
        state.active[torch.tensor(list(rows), device=state.active.device)] = False


def finish_and_advance(state: StepState, new_tokens: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor) -> None:
    """After a step that emitted ``new_tokens[b, :accepted[b] + 1]`` per row: end the rows
    whose emitted tokens hold a stop id, and those that spent their budget (the host
    cuts their tokens there; whether a stop id lies past the cut does not change that
    they end); move the others past their tokens (``bonus`` is their new ``current``).
    A row that ends stays where it was: later (ignored) steps must not run past the
    cache it was admitted for."""
    emitted = accepted + 1
    width = new_tokens.shape[1]
    inside = torch.arange(width, device=new_tokens.device)[None, :] < emitted[:, None]
    stopped = ((new_tokens[:, :, None] == state.stops[:, None, :]).any(-1) & inside).any(-1)
    live = state.active & ~stopped & (emitted < state.remaining)
    state.length = torch.where(live, state.length + emitted, state.length)
    state.current = torch.where(live, bonus, state.current)
    state.remaining = torch.where(live, state.remaining - emitted, state.remaining)
    state.active = live
