"""Speculative decoding with EAGLE / EAGLE3 chain drafts over a DCP-sharded target.

Every graph's role is fixed when it is compiled: the target's prefill and verify
graphs are sharded (``dcp.backend(group, "target")``, ``verify=True``), the draft's
extend and step graphs are whole (``dcp.backend(group, "draft")``).  Nothing is
switched between draft and target calls.

One step, for every sequence of the batch at once (static shapes, ragged counts):

1. verify ``[t0, d1..dk]`` at positions ``L..L+k`` with the target: logits and the
   EAGLE features of each position; the new K/V wait in staging slots;
2. accept: greedy (the longest prefix where the target's argmax equals the draft, plus
   the target's token after it) or rejection sampling (temperature > 0);
3. commit the K/V of ``t0, d1..da`` to their owner slots;
4. draft-extend over the accepted positions, which yields ``d1`` of the next step;
5. draft ``d2..dk`` as a chain (one token per step).

The draft at position ``p`` reads the target's feature at ``p`` and token ``p + 1`` and
proposes token ``p + 2`` (the EAGLE convention).

Sampling runs on the device: every random number comes from one device generator
seeded identically on all ranks, and the merged logits are bitwise the same on all
ranks, so every rank accepts the same tokens without communicating.  The host reads
one small tensor per step (the emitted tokens, their counts and the accept counts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dcp_compile.backend import backend as make_backend
from dcp_compile.runtime.commit import KVCommit
from dcp_compile.runtime.generate import DEFAULT_CHUNK_SIZE, check_chunk_size, prefill_chunks
from dcp_compile.group import DCPGroup, ranks_that_differ
from dcp_compile.runtime.prepare import prepare


@dataclass
class RequestOutput:
    tokens: list[int] = field(default_factory=list)
    """Generated tokens (target vocabulary), EOS included when it ended the request."""
    accepted: list[int] = field(default_factory=list)
    """Per verify step: how many draft tokens the target accepted (0..k)."""
    finished_by: str = ""
    """``"eos"``, ``"length"`` or ``"refused"``."""
    error: str | None = None
    """Why the request was refused at admission."""

    @property
    def mean_accept_length(self) -> float:
        """Tokens per verify step: accepted drafts plus the target's own token."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 0.0


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs [..., V]``, on the device: the first of V exponential
    clocks with rates ``probs`` to ring, ``argmax(probs / E)``, is distributed as
    ``probs``, with no host sync (``torch.multinomial`` on CUDA synchronizes)."""
    clocks = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / clocks).argmax(-1)


def accept_chain(
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of ``drafts [B, k]`` the target accepts, and the token that follows them.

    ``target_logits [B, k+1, V]``: the target's logits after ``t0, d1..dk``.

    Greedy (temperature 0): accept ``d_j`` while it equals the target's argmax; the
    next token is the target's argmax after the last accepted draft.

    Sampling: accept ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the
    first rejection sample from ``norm(max(0, p_j - q_j))``; if all ``k`` are accepted,
    sample the bonus from ``p_{k+1}``.  The emitted tokens are then distributed exactly
    as the target's own samples (rejection sampling).  Everything stays on the device of
    the logits; ``generator`` must live there too.
    """
    B, k = drafts.shape
    if temperature == 0:
        greedy = target_logits.argmax(-1)  # [B, k+1]
        matches = (drafts == greedy[:, :k]).long().cumprod(dim=1)
        accepted = matches.sum(dim=1)
        return accepted, greedy.gather(1, accepted[:, None])[:, 0]
    p = _probs(target_logits, temperature)  # [B, k+1, V]
    q = draft_probs.float()
    p_d = p[:, :k].gather(2, drafts[..., None])[..., 0]
    q_d = q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(B, k, generator=generator, device=p.device)
    ok = (u * q_d < p_d).long().cumprod(dim=1)
    accepted = ok.sum(dim=1)
    rows = torch.arange(B, device=p.device)
    at = accepted.clamp(max=k - 1)
    residual = (p[rows, at] - q[rows, at]).clamp(min=0)
    # All accepted: the bonus comes from the target alone.
    weights = torch.where((accepted == k)[:, None], p[rows, k], residual)
    # A residual of all zeros (p == q) cannot happen on rejection; guard the division anyway.
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, p[rows, accepted])
    return accepted, sample_from(weights / weights.sum(-1, keepdim=True), generator)


class SpecDecoder:
    """EAGLE / EAGLE3 chain speculative decoding over a DCP group.

    ``target``: a model whose forward is ``(tokens, positions) -> (logits, features)``
    (e.g. ``Llama`` with ``aux_layers``).  ``draft``: an ``EagleDraft`` built for it.
    ``comm``: how the target's partial attentions meet (``"ag"`` or ``"a2a"``, see
    ``dcp.backend``).  ``cuda_graphs``: capture the per-step calls (verify, commit, draft
    extend and step) in CUDA graphs once per shape and replay them.  ``check_ranks``: after
    the prefill and every verify, compare a checksum of the merged logits and the accept
    decisions across ranks (one small eager all-gather per step) and raise on the first
    difference; a debugging aid, since ranks that disagree would otherwise run different
    numbers of steps and hang in a collective.  ``chunk_size``: prompt tokens per row
    and prefill step (default ``min(DEFAULT_CHUNK_SIZE, max_seq_len)``); every prompt, however long, is fed in ``[max_batch, chunk_size]``
    chunks (one compiled graph each for the target and the draft), so a prefill's
    memory is bounded by the chunk and a new prompt width never recompiles.
    """

    def __init__(
        self,
        target: nn.Module,
        draft: nn.Module,
        group: DCPGroup,
        *,
        k: int,
        max_batch: int,
        max_seq_len: int,
        topk: int = 1,
        temperature: float = 0.0,
        seed: int = 0,
        lowering: str = "inductor",
        comm: str = "ag",
        cuda_graphs: bool = False,
        check_ranks: bool = False,
        chunk_size: int | None = None,
    ):
        chunk_size = min(DEFAULT_CHUNK_SIZE, max_seq_len) if chunk_size is None else chunk_size
        check_chunk_size(chunk_size, max_seq_len)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k (draft tokens per step) must be an int >= 1, got {k!r}")
        if topk != 1:
            raise ValueError(
                f"topk={topk} asks for tree drafts, which are not supported yet: only chain drafts (topk=1) "
                f"are implemented. Use topk=1"
            )
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        target_vocab = target.cfg.vocab_size
        if draft.cfg.target.vocab_size != target_vocab:
            raise ValueError(
                f"the draft was built for a target vocabulary of {draft.cfg.target.vocab_size} tokens but the target "
                f"has {target_vocab}, and no draft-to-target map covers the difference; build the draft with "
                f"DraftConfig(target=target.cfg, ...) (an EAGLE3 draft vocabulary maps to target ids through d2t)"
            )
        if not target.cfg.aux_layers:
            raise ValueError("the target must return EAGLE features: build it with LlamaConfig(aux_layers=...)")
        if cuda_graphs and group.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; this group computes on {group.device}")
        # Every argument is checked above: nothing below may fail on one, since prepare
        # changes the models for good.
        self.target, self.draft, self.group = target, draft, group
        self.k, self.temperature, self.seed = k, temperature, seed
        self.chunk_size = chunk_size
        self.check_ranks = check_ranks and group.size > 1
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.device = group.device
        prepare(target, group, "target", max_batch=max_batch, max_seq_len=max_seq_len, verify_tokens=k + 1)
        feature_width = target.cfg.dim * len(target.cfg.aux_layers)
        draft_example = (
            torch.zeros(max_batch, 1, dtype=torch.long, device=self.device),
            torch.zeros(max_batch, 1, dtype=torch.long, device=self.device),
            torch.zeros(max_batch, 1, feature_width, device=self.device, dtype=draft.fc.weight.dtype),
        )
        prepare(draft, group, "draft", max_batch=max_batch, max_seq_len=max_seq_len, example_inputs=draft_example)

        # Captured steps cannot sync to check positions on the host; admission control
        # below already keeps every request inside the cache.
        checked = not cuda_graphs
        self.target_backend = make_backend(group, "target", lowering=lowering, comm=comm)
        self.verify_backend = make_backend(group, "target", verify=True, lowering=lowering, comm=comm, check_positions=checked)
        self.draft_backend = make_backend(group, "draft", lowering=lowering, check_positions=checked)
        self.target_prefill = torch.compile(target, backend=self.target_backend, fullgraph=True, dynamic=False)
        self.target_verify = torch.compile(target, backend=self.verify_backend, fullgraph=True, dynamic=False)
        self.draft_forward = torch.compile(draft, backend=self.draft_backend, fullgraph=True, dynamic=False)
        self.commit = KVCommit(target)
        self.commit_c = torch.compile(self.commit, backend=lowering, fullgraph=True, dynamic=False)
        # The per-step calls (verify, commit, draft extend and chain step) have fixed
        # shapes; prefills vary with the prompts and stay uncaptured.
        self.graph_runners: list = []
        self.draft_step = self.draft_forward
        if cuda_graphs:
            from dcp_compile.runtime.cuda_graphs import GraphRunner

            pool = torch.cuda.graph_pool_handle()
            self.target_verify, self.commit_c, self.draft_step = (
                GraphRunner(fn, pool=pool) for fn in (self.target_verify, self.commit_c, self.draft_forward)
            )
            self.graph_runners = [self.target_verify, self.commit_c, self.draft_step]

    def _check_ranks_agree(self, step: int, logits: torch.Tensor, *decisions: torch.Tensor) -> None:
        checksum = torch.cat([logits.double().sum(-1).flatten(), *(d.double().flatten() for d in decisions)])
        differ = ranks_that_differ(self.group, checksum)
        if differ:
            where = "after the prefill" if step == 0 else f"at verify step {step}"
            raise RuntimeError(
                f"DCP ranks diverged {where}: ranks {differ} hold different merged target logits or accept "
                f"decisions than rank 0, where every rank must hold bitwise the same. A rank's step read other "
                f"inputs than the rest (a stale captured buffer, a cache written out of order) or its graph "
                f"differs; rerun with cuda_graphs=False to see whether capture is involved"
            )

    def _choose(self, logits: torch.Tensor, generator) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(-1)
        return sample_from(_probs(logits, self.temperature), generator)

    def _draft_propose(self, logits: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft token (target ids) and, when sampling, the draft's distribution over target ids."""
        vocab = self.target.cfg.vocab_size
        ids = self.draft.to_target_ids(torch.arange(logits.shape[-1], device=logits.device))
        if self.temperature == 0:
            return ids[logits.argmax(-1)], None
        q_draft = _probs(logits, self.temperature)
        q = torch.zeros(logits.shape[0], vocab, dtype=q_draft.dtype, device=logits.device).index_add_(1, ids, q_draft)
        return sample_from(q, generator), q

    def _prefill(self, prompts: Sequence[Sequence[int]], generator):
        """Feed the prompts chunk by chunk through the target and then the draft.

        Returns the prompt lengths, the token sampled after each prompt, and the
        draft's logits and hidden state at the last prompt position, which propose the
        first draft token.  The draft's chunk reads the target's features of the same
        chunk and the token one ahead; at a row's last prompt position that token is the
        one just sampled, so the draft runs after the target's logits are in.
        """
        rows = torch.arange(self.max_batch, device=self.device)
        current = q_logits = hidden = None
        for chunk in prefill_chunks(prompts, self.chunk_size, self.max_seq_len, self.device):
            last = chunk.last[:, None]
            logits, features = self.target_prefill(chunk.tokens, chunk.positions, last)
            sampled = self._choose(logits[:, 0], generator)
            if self.check_ranks:
                self._check_ranks_agree(0, logits[:, 0], sampled)
            current = sampled if current is None else torch.where(chunk.ends, sampled, current)
            next_tokens = chunk.next_tokens.clone()
            next_tokens[rows, chunk.last] = torch.where(chunk.ends, current, next_tokens[rows, chunk.last])
            chunk_q, chunk_hidden = self.draft_forward(next_tokens, chunk.positions, features, last)
            ends = chunk.ends[:, None]
            q_logits = chunk_q[:, 0] if q_logits is None else torch.where(ends, chunk_q[:, 0], q_logits)
            hidden = chunk_hidden if hidden is None else torch.where(ends[:, :, None], chunk_hidden, hidden)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        return lengths, current, q_logits, hidden

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        eos_id: int | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> list[RequestOutput]:
        """Decode every prompt; ``on_tokens(request, new_tokens)`` streams as tokens are accepted."""
        if len(prompts) > self.max_batch:
            raise ValueError(f"{len(prompts)} prompts exceed max_batch={self.max_batch}; split the batch")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        k, B, dev = self.k, self.max_batch, self.device
        outputs = [RequestOutput() for _ in prompts]
        rows_prompts: list[Sequence[int]] = []
        for i, prompt in enumerate(prompts):
            need = len(prompt) + max_new_tokens + k + 1
            if len(prompt) == 0 or need > self.max_seq_len:
                outputs[i].finished_by, outputs[i].error = "refused", (
                    f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} + verify window {k + 1} needs "
                    f"{need} cache positions; the cache holds max_seq_len={self.max_seq_len}"
                    if prompt else "empty prompt"
                )
                rows_prompts.append([0])
            else:
                rows_prompts.append(prompt)
        rows_prompts += [[0]] * (B - len(prompts))
        live = [o.finished_by == "" for o in outputs] + [False] * (B - len(prompts))
        active = torch.tensor(live, device=dev)
        generator = torch.Generator(device=dev).manual_seed(self.seed)
        rows = torch.arange(B, device=dev)

        def emit(new_tokens: torch.Tensor, counts: torch.Tensor, accepted: torch.Tensor | None = None) -> None:
            """Hand the step's tokens to the requests: one device-to-host copy for the batch."""
            width = new_tokens.shape[1]
            packed = torch.cat([new_tokens, counts[:, None], (accepted if accepted is not None else counts)[:, None]], 1)
            host = packed.tolist()
            for i, out in enumerate(outputs):
                if not live[i]:
                    continue
                if accepted is not None:
                    out.accepted.append(host[i][width + 1])
                fresh = host[i][: host[i][width]]
                fresh = fresh[: max_new_tokens - len(out.tokens)]
                if eos_id is not None and eos_id in fresh:
                    fresh = fresh[: fresh.index(eos_id) + 1]
                    out.finished_by = "eos"
                out.tokens += fresh
                if not out.finished_by and len(out.tokens) >= max_new_tokens:
                    out.finished_by = "length"
                if fresh and on_tokens is not None:
                    on_tokens(i, fresh)
                if out.finished_by:
                    live[i] = False

        lengths, current, q_logits, hidden = self._prefill(rows_prompts, generator)
        emit(current[:, None], torch.ones(B, dtype=torch.long, device=dev))
        active = torch.tensor(live, device=dev)
        length = lengths.clone()  # committed target tokens; `current` sits at position `length`

        steps = torch.arange(k + 1, device=dev)
        verify_step = 0
        while any(live):
            verify_step += 1
            drafts, draft_probs = [], []
            for j in range(k):
                token, q = self._draft_propose(q_logits, generator)
                drafts.append(token)
                draft_probs.append(q)
                if j < k - 1:
                    step_logits, step_hidden = self.draft_step(token[:, None], (length + j)[:, None], hidden)
                    q_logits, hidden = step_logits[:, 0], step_hidden
            drafts = torch.stack(drafts, dim=1)  # [B, k]
            verify_tokens = torch.cat([current[:, None], drafts], dim=1)
            verify_positions = length[:, None] + steps
            logits, features = self.target_verify(verify_tokens, verify_positions)
            probs = torch.stack(draft_probs, dim=1) if self.temperature > 0 else None
            accepted, bonus = accept_chain(logits, drafts, probs, self.temperature, generator)
            accepted = torch.where(active, accepted, 0)
            if self.check_ranks:
                self._check_ranks_agree(verify_step, logits, drafts, accepted, bonus)
            new_tokens = torch.cat([drafts, bonus[:, None]], dim=1)
            new_tokens[rows, accepted] = bonus
            committed = torch.where(active, accepted + 1, 0)
            self.commit_c(length, committed)
            # Draft-extend over the accepted positions: (feature_p, token_{p+1}) for p = L..L+a.
            extend_tokens = torch.where(steps[None, :] < accepted[:, None], new_tokens, bonus[:, None])
            extend_logits, extend_hidden = self.draft_step(extend_tokens, verify_positions, features, accepted[:, None])
            q_logits, hidden = extend_logits[:, 0], extend_hidden
            # The host reads the step only now, with the commit and the draft queued.
            emit(new_tokens, accepted + 1, accepted)
            active = torch.tensor(live, device=dev)
            # A row that finished stays where it was: its later (ignored) verify windows
            # must not run past the cache it was admitted for.
            length = torch.where(active, length + accepted + 1, length)
            current = torch.where(active, bonus, current)
        return outputs
