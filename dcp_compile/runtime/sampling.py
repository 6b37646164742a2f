"""The sampler of speculative decoding, on the device: seeded noise, one token drawn per
row without a host sync, and the acceptance rule of a draft chain.

Every random number comes from device generators seeded identically on all ranks
(``Noise``), and the merged logits are bitwise the same on all ranks, so every rank
draws and accepts the same tokens without communicating.
"""

from __future__ import annotations

import torch


def logprobs_at(logits: torch.Tensor, divisor: float | torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / divisor)`` in fp32 in two passes over the logits: a divisor
    tensor (fp32) upcasts in the division itself, then one fused log-softmax."""
    scaled = logits / divisor if isinstance(divisor, torch.Tensor) and divisor.dtype == torch.float32 \
        else logits.float() / divisor
    return torch.log_softmax(scaled, dim=-1)


def probs_at(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """The fp32 distribution ``logits`` sample from at ``temperature`` (a float, or a
    divisor shaped for ``logits``)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


class Noise:
    """The sampler's random numbers, on the device.  One generator, seeded alike on every
    rank, serves the batch; a request with its own ``seed`` draws its row from a generator
    of its own, so its tokens depend on its seed alone, not on the requests it shares a
    batch with.  Every rank makes the same draws, so ranks agree without communicating.

    ``rows``: the batch's rows, each with a generator of its own made once and reseeded
    by ``seed_row``, so that a captured step (``runtime.step_graph``), which holds the
    generators it was captured with, sees a new request's seed.  While any row is seeded,
    every draw takes each row's numbers from its own generator too and keeps them where
    the row is seeded (``seeded``, a device mask): the same kernels whichever rows are
    seeded, and a seeded row's numbers are those its generator alone would give."""

    def __init__(self, device: torch.device, seed: int, rows: int = 0):
        self.device = torch.device(device)
        self.shared = torch.Generator(device=self.device).manual_seed(seed)
        self.row_generators = [torch.Generator(device=self.device) for _ in range(rows)]
        self.seeded = torch.zeros(rows, dtype=torch.bool, device=self.device)
        self.rows: set[int] = set()
        """The rows seeded now (the host's view of ``seeded``)."""

    def reset(self, seed: int) -> None:
        """Start over from ``seed`` with no row seeded, keeping the generators (a captured
        step holds them)."""
        self.shared.manual_seed(seed)
        self.rows.clear()
        self.seeded.zero_()

    def seed_row(self, row: int, seed: int | None) -> None:
        if not 0 <= row < len(self.row_generators):
            raise ValueError(f"Noise: row {row} is outside the {len(self.row_generators)} rows it was made for "
                             f"(Noise(device, seed, rows=max_batch))")
        was_seeded = row in self.rows
        if seed is None:
            self.rows.discard(row)
        else:
            self.row_generators[row].manual_seed(seed)
            self.rows.add(row)
        if was_seeded != (seed is not None):
            # fill_ passes the value in the kernel's arguments; an assignment from a
            # Python bool copies it from pageable host memory, which waits for every step
            # queued on the device (each finished row would stall the loop a step).
            self.seeded[row].fill_(seed is not None)

    def _per_row(self, shared: torch.Tensor, draw) -> torch.Tensor:
        """``shared [B, ...]`` with each seeded row's draws from its own generator
        (``draw(generator) -> [...]``, one row's worth)."""
        if not self.rows:
            return shared
        B = shared.shape[0]
        if B > len(self.row_generators):
            raise ValueError(f"Noise: a draw for {B} rows, but it holds generators for {len(self.row_generators)}")
        own = torch.stack([draw(generator) for generator in self.row_generators[:B]])
        return torch.where(self.seeded[:B].view(B, *([1] * (shared.dim() - 1))), own, shared)

    def exponential(self, like: torch.Tensor) -> torch.Tensor:
        """Exponential(1) draws shaped as ``like [B, ...]``, row ``b`` from its own generator."""
        draws = torch.empty_like(like).exponential_(1.0, generator=self.shared)
        return self._per_row(draws, lambda g: torch.empty_like(like[0]).exponential_(1.0, generator=g))

    def uniform(self, *shape: int) -> torch.Tensor:
        draws = torch.rand(*shape, generator=self.shared, device=self.device)
        return self._per_row(draws, lambda g: torch.rand(*shape[1:], generator=g, device=self.device))


def sample_from(probs: torch.Tensor, noise: Noise | torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs [..., V]``, on the device: the first of V exponential
    clocks with rates ``probs`` to ring, ``argmax(probs / E)``, is distributed as
    ``probs``, with no host sync (``torch.multinomial`` on CUDA synchronizes)."""
    return (probs / exponential_draws(noise, probs)).argmax(-1)


def uniform_draws(noise: Noise | torch.Generator | None, shape: tuple[int, ...], device) -> torch.Tensor:
    """U[0, 1) draws of ``shape`` (batch first), from ``noise`` (row by row) or a generator."""
    if isinstance(noise, Noise):
        return noise.uniform(*shape)
    return torch.rand(*shape, generator=noise, device=device)


def row_temperatures(temperature: float | torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor | float, torch.Tensor | None]:
    """``(divisor, sampled rows)``: a per-row temperature tensor ``[B]`` becomes a divisor
    ``[B, 1, ...]`` shaped for ``logits`` (greedy rows divide by 1, their samples unused)
    and a ``[B]`` mask of the rows that sample; a float stays as it is."""
    if not isinstance(temperature, torch.Tensor):
        return temperature, None
    sampled = temperature > 0
    divisor = torch.where(sampled, temperature, 1.0).view(-1, *([1] * (logits.dim() - 1)))
    return divisor, sampled


def accept_chain(
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: float | torch.Tensor,
    generator: Noise | torch.Generator | None,
    rule=None,
    *,
    draft_index: torch.Tensor | None = None,
    vocab_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of ``drafts [B, k]`` the target accepts, and the token that follows them.

    ``target_logits [B, k+1, V]``: the target's logits after ``t0, d1..dk``.
    ``temperature``: one for the batch, or ``[B]`` per row (0: that row is greedy).

    Greedy (temperature 0): accept ``d_j`` while it equals the target's argmax; the
    next token is the target's argmax after the last accepted draft.

    Sampling: accept ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the
    first rejection sample from ``norm(max(0, p_j - q_j))``; if all ``k`` are accepted,
    sample the bonus from ``p_{k+1}``.  The emitted tokens are then distributed exactly
    as the target's own samples (rejection sampling).  Everything stays on the device of
    the logits; ``generator`` must live there too.

    ``draft_probs [B, k, V_q]``: the draft's distributions, over the target's vocabulary,
    or over a draft vocabulary whose id ``i`` is target id ``vocab_map[i]``; then
    ``draft_index [B, k]`` are the drafts' draft ids.

    The random numbers are drawn here; ``rule`` (default ``chain_rule``, or a compiled
    copy of it) takes every decision from them.
    """
    if draft_probs is None:
        return greedy_chain(target_logits, drafts)
    B, k = drafts.shape
    u = uniform_draws(generator, (B, k), target_logits.device)
    clocks = exponential_draws(generator, target_logits.new_empty(B, target_logits.shape[-1], dtype=torch.float32))
    return (rule or chain_rule)(target_logits, drafts, draft_probs, temperature, u, clocks,
                                drafts if draft_index is None else draft_index, vocab_map)


def greedy_chain(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_chain`` at temperature 0."""
    k = drafts.shape[1]
    greedy = target_logits.argmax(-1)  # [B, k+1]
    accepted = (drafts == greedy[:, :k]).long().cumprod(dim=1).sum(dim=1)
    return accepted, greedy.gather(1, accepted[:, None])[:, 0]


def chain_rule(target_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor,
               temperature: float | torch.Tensor, u: torch.Tensor, clocks: torch.Tensor, draft_index: torch.Tensor,
               vocab_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_chain``'s decisions from its random numbers: ``u [B, k]`` uniforms for the
    drafts, ``clocks [B, V]`` exponentials for the token after them.  No randomness and
    no host sync, so it compiles into a few fused kernels."""
    B, k = drafts.shape
    divisor, sampled_rows = row_temperatures(temperature, target_logits)
    # Only the drafts' probabilities and one full row per sequence are read: p at the
    # drafts, and p where the bonus is drawn.
    logp = logprobs_at(target_logits, divisor)  # [B, k+1, V]
    p_d = logp[:, :k].gather(2, drafts[..., None])[..., 0].exp()
    q_d = draft_probs.gather(2, draft_index[..., None])[..., 0].float()
    ok = (u * q_d < p_d).long().cumprod(dim=1)
    accepted = ok.sum(dim=1)
    rows = torch.arange(B, device=logp.device)
    p = logp[rows, accepted].exp()  # [B, V] after the last accepted draft
    q = draft_probs[rows, accepted.clamp(max=k - 1)].float()
    if vocab_map is not None:  # the one row the residual needs, in the target's ids
        q = torch.zeros_like(p).index_add(1, vocab_map, q)
    residual = (p - q).clamp(min=0)
    # All accepted: the bonus comes from the target alone.
    weights = torch.where((accepted == k)[:, None], p, residual)
    # A residual of all zeros (p == q) cannot happen on rejection; guard the division anyway.
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, p)
    bonus = (weights / weights.sum(-1, keepdim=True) / clocks).argmax(-1)
    if sampled_rows is None:
        return accepted, bonus
    greedy_accepted, greedy_bonus = greedy_chain(target_logits, drafts)
    return torch.where(sampled_rows, accepted, greedy_accepted), torch.where(sampled_rows, bonus, greedy_bonus)


def propose_rule(logits: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor,
                 clocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft token from the draft's ``logits [B, V_draft]`` with ``clocks [B, V_draft]``
    exponentials (greedy rows take the argmax): its target id (``ids``: each draft id's
    target id), its draft id, and the draft's distribution over its own vocabulary.
    Drawing over the draft's vocabulary and mapping the id draws from the same
    distribution as drawing over the target's, at a fraction of the bytes."""
    divisor, sampled_rows = row_temperatures(temperature, logits)
    q = probs_at(logits, divisor)
    index = torch.where(sampled_rows, (q / clocks).argmax(-1), logits.argmax(-1))
    return ids[index], index, q


def exponential_draws(noise: Noise | torch.Generator | None, like: torch.Tensor) -> torch.Tensor:
    """Exponential(1) draws shaped as ``like``, from ``noise`` (row by row) or a generator."""
    if isinstance(noise, Noise):
        return noise.exponential(like)
    return torch.empty_like(like).exponential_(1.0, generator=noise)


def fused(rule, lowering: str):
    """One of the sampler's rules (``chain_rule``, ``propose_rule``: decisions from random
    numbers) compiled by Inductor like the models' graphs, when they are; the draws stay
    outside, since a compiled graph takes no generator."""
    return torch.compile(rule, backend="inductor", fullgraph=True, dynamic=False) if lowering == "inductor" else rule
