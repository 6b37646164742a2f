"""Speculative decoding with EAGLE / EAGLE3 chain drafts over a DCP-sharded target.

Every graph's role is fixed when it is compiled: the target's prefill and verify graphs
are sharded (``dcp.backend(group, "target")``, ``verify=True``), the draft's extend and
step graphs whole (``dcp.backend(group, "draft")``).  Nothing is switched between calls.

One step, for every sequence of the batch at once (static shapes, ragged counts):

1. verify ``[t0, d1..dk]`` at positions ``L..L+k`` with the target: logits and the
   EAGLE features of each position; the new K/V wait in staging slots;
2. accept: greedy (the longest prefix where the target's argmax equals the draft, plus
   the target's token after it) or rejection sampling (temperature > 0);
3. commit the K/V of ``t0, d1..da`` to their owner slots;
4. draft-extend over the accepted positions, which yields ``d1`` of the next step;
5. draft ``d2..dk`` as a chain (one token per step).

The draft at position ``p`` reads the target's feature at ``p`` and token ``p + 1``
and proposes token ``p + 2`` (the EAGLE convention).

Sampling runs on the device (``sampling``: seeded ``Noise`` alike on every rank, and the
acceptance rule), so every rank accepts the same tokens without communicating; the host
reads one small tensor a step (the emitted tokens and the accept counts).

Three parts: ``SpecGraphs`` prepares the models and compiles the step graphs (after
``SpecDecoder`` has checked every argument); ``DeviceStep`` runs a prefill or a step on
the device; ``engine.SpecEngine`` (which uses a decoder, never the reverse) keeps the
requests on the host and admits them into rows (``engine.generate_all`` loops over one).
Models meet the decoder through a protocol (``SpecTarget``, ``SpecDraft``), not configs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from dcp_compile.backend import backend as make_backend
from dcp_compile.runtime.commit import KVCommit
from dcp_compile.runtime.generate import DEFAULT_CHUNK_SIZE, check_chunk_size, prefill_chunks, tokens_prefilled
from dcp_compile.group import DCPGroup, ranks_that_differ
from dcp_compile.memory import step_reserve_bytes
from dcp_compile.runtime.paging import PoolBudget
from dcp_compile.runtime.row_pages import draft_token_bytes
from dcp_compile.runtime.prepare import prepare
from dcp_compile.ops.inlining import KERNELS
from dcp_compile.ops.tree_mask import TreeCall
from dcp_compile.runtime.sampling import (Noise, accept_chain, chain_rule, exponential_draws, fused, probs_at,
                                          propose_rule, row_temperatures, sample_from)
from dcp_compile.runtime.tree import TreeShape, accept_sampled, spec_tree_shape
from dcp_compile.runtime.state import STOP_IDS_PER_ROW, StepState, finish_and_advance, idle_state
from dcp_compile.runtime.step_graph import StepGraph, StepParts
from dcp_compile.runtime.tree_step import TreeStep


class SpecTarget(Protocol):
    """What the decoder needs of a target: ``forward(tokens, positions, logits_at=None) ->
    (logits, features)`` and these two facts."""

    vocab_size: int
    feature_width: int
    """Width of the EAGLE features forward returns beside the logits (0: none)."""


class SpecDraft(Protocol):
    """What the decoder needs of a draft: ``forward(tokens, positions, features,
    logits_at=None) -> (logits, hidden)``, its ids mapped to the target's, and these."""

    target_vocab_size: int
    feature_width: int
    """Width of the target features it reads."""
    dtype: torch.dtype

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...


def _pool_budget(target, draft, max_batch: int, verify_tokens: int, memory_fraction: float) -> PoolBudget:
    """A pool sized from free memory keeps the planner's reserve for a step, and charges each
    token the draft's store of indexed pages, whether or not the engine caches prefixes."""
    reserve = step_reserve_bytes(max_batch, verify_tokens, target.vocab_size)
    return PoolBudget(memory_fraction, reserve, draft_token_bytes(draft))


class SpecGraphs:
    """Prepares the target (sharded) and the draft (whole) and compiles the step graphs,
    each with its role fixed: target prefill chunk and verify, the commit, the draft's
    chunk, extend and step; with ``cuda_graphs`` the per-step calls are captured once per
    shape (``parts``), and ``compiled`` keeps them uncaptured for a capture of the whole
    step (``runtime.step_graph``).  Its arguments must have been checked: ``prepare``
    changes the models for good."""

    def __init__(self, target, draft, group: DCPGroup, *, k: int, max_batch: int, max_seq_len: int, lowering: str,
                 comm: str, cuda_graphs: bool, tree: TreeShape | None = None, kernels: str = "inline",
                 page_size: int = 0, kv_tokens: int | None = None, memory_fraction: float = 0.9):
        device, verify_tokens = group.device, k + 1 if tree is None else tree.verify_tokens
        if draft is not None:  # first, so that a pool sized from free memory leaves the draft's cache its room
            draft_example = (
                torch.zeros(max_batch, 1, dtype=torch.long, device=device),
                torch.zeros(max_batch, 1, dtype=torch.long, device=device),
                torch.zeros(max_batch, 1, target.feature_width, device=device, dtype=draft.dtype),
            )
            prepare(draft, group, "draft", max_batch=max_batch, max_seq_len=max_seq_len, example_inputs=draft_example,
                    tree_slots=0 if tree is None else tree.tree_slots)
        self.paging = prepare(target, group, "target", max_batch=max_batch, max_seq_len=max_seq_len,
                              tree=tree is not None, verify_tokens=verify_tokens, page_size=page_size,
                              kv_tokens=kv_tokens,
                              pool_budget=_pool_budget(target, draft, max_batch, verify_tokens, memory_fraction)).paging
        # Captured steps cannot sync to check positions on the host; admission control
        # already keeps every request inside the cache.
        checked = not cuda_graphs
        self.target_backend = make_backend(group, "target", lowering=lowering, comm=comm, kernels=kernels)
        self.verify_backend = make_backend(group, "target", verify=True, lowering=lowering, comm=comm, kernels=kernels,
                                           check_positions=checked)
        self.target_prefill = torch.compile(target, backend=self.target_backend, fullgraph=True, dynamic=False)
        # A tree's verify and draft depths take its ancestor mask beside the positions.
        verified = target if tree is None else TreeCall(target)
        self.target_verify = torch.compile(verified, backend=self.verify_backend, fullgraph=True, dynamic=False)
        self.draft_backend = self.draft_forward = self.draft_tree = None
        if draft is not None:
            self.draft_backend = make_backend(group, "draft", lowering=lowering, check_positions=checked,
                                              kernels=kernels)
            self.draft_forward = torch.compile(draft, backend=self.draft_backend, fullgraph=True, dynamic=False)
        if tree is not None:
            self.draft_tree = [torch.compile(TreeCall(draft, staged=True), backend=self.draft_backend, fullgraph=True,
                                             dynamic=False) for _ in range(tree.k - 1)]  # one per depth after the first
        self.chain_rule, self.propose_rule = fused(chain_rule, lowering), fused(propose_rule, lowering)
        self.tree_rule = fused(accept_sampled, lowering)
        self.commit = KVCommit(target)
        # A group of size 1 verifies a chain in place: there is nothing to commit, and a
        # captured commit would be an empty CUDA graph replayed (with its input copies) every step.
        self.commit_c = (torch.compile(self.commit, backend=lowering, fullgraph=True, dynamic=False)
                         if self.commit.needed else None)
        # The per-step calls (verify, commit, draft extend and chain step) have fixed
        # shapes; prefill chunks stay uncaptured.
        self.graph_runners: list = []
        self.draft_step = self.draft_forward
        self.compiled = self.parts
        self.pool = None
        if cuda_graphs:
            from dcp_compile.runtime.cuda_graphs import GraphRunner

            pool = self.pool = torch.cuda.graph_pool_handle()
            self.target_verify = GraphRunner(self.target_verify, pool=pool)
            if self.draft_forward is not None:
                self.draft_step = GraphRunner(self.draft_forward, pool=pool)
            if self.draft_tree is not None:
                self.draft_tree = [GraphRunner(depth, pool=pool) for depth in self.draft_tree]
            if self.commit_c is not None:
                self.commit_c = GraphRunner(self.commit_c, pool=pool)
            self.graph_runners = [r for r in (self.target_verify, self.commit_c, self.draft_step, *(self.draft_tree or ()))
                                  if r is not None]

    @property
    def parts(self) -> StepParts:
        """The step's calls as a step makes them: captured one by one under ``cuda_graphs``."""
        return StepParts(self.target_verify, self.commit_c, self.draft_step, self.draft_tree)


class DeviceStep:
    """Prefill and speculative steps on the device, for every row of the batch at once.
    Nothing here reads the device from the host, except the optional rank check."""

    def __init__(self, graphs: SpecGraphs, group: DCPGroup, *, k: int, max_batch: int, max_seq_len: int,
                 chunk_size: int, check_ranks: bool, target_vocab: int, draft: SpecDraft | None,
                 target_features: bool, tree: TreeShape | None = None):
        self.graphs, self.group, self.k = graphs, group, k
        self.target_features = target_features
        """Whether the target returns ``(logits, features)`` rather than the logits alone."""
        self.max_batch, self.max_seq_len, self.chunk_size = max_batch, max_seq_len, chunk_size
        self.check_ranks = check_ranks and group.replica_size > 1
        self.target_vocab, self.draft = target_vocab, draft
        self.device = group.device
        self.rows = torch.arange(max_batch, device=self.device)
        self.steps = torch.arange(k + 1, device=self.device)
        self.verify_steps = 0
        self.tree = None if tree is None else TreeStep(tree, draft=draft, max_batch=max_batch, device=self.device)
        self.step_graph = None
        """``runtime.step_graph.StepGraph`` over ``run_step`` and the uncaptured parts, or ``None``."""

    def check_ranks_agree(self, step: int, logits: torch.Tensor, *decisions: torch.Tensor) -> None:
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

    def choose(self, logits: torch.Tensor, temperature: torch.Tensor, sampling: bool, noise: Noise) -> torch.Tensor:
        greedy = logits.argmax(-1)
        if not sampling:
            return greedy
        divisor, sampled_rows = row_temperatures(temperature, logits)
        return torch.where(sampled_rows, sample_from(probs_at(logits, divisor), noise), greedy)

    def propose(self, logits: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor, sampling: bool,
                noise: Noise) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A draft token's target id (``ids``: each draft id's) and, sampling, its draft id and ``q``."""
        if not sampling:
            return ids[logits.argmax(-1)], None, None
        clocks = exponential_draws(noise, logits.new_empty(logits.shape, dtype=torch.float32))
        return self.graphs.propose_rule(logits, ids, temperature, clocks)

    def prefill(self, prompts: Sequence[Sequence[int]], admitted: Sequence[bool], temperature: Sequence[float],
                noise: Noise, state: StepState | None = None, *, starts: Sequence[int] | None = None,
                max_chunks: int | None = None, stop_width: int = STOP_IDS_PER_ROW) -> StepState:
        """Feed the ``admitted`` rows' prompts chunk by chunk through the target and then
        the draft, while the other rows keep what ``state`` holds for them.

        ``starts``: row ``r``'s ``prompts[r]`` is the rest of a prompt whose first
        ``starts[r]`` tokens are already in the caches (a prefill resumed).
        ``max_chunks``: stop after that many chunks; a row whose prompt is not done then
        has its length at the next chunk's first position (its later, ignored steps
        write only slots that chunk overwrites before anything reads them), and only
        the rows that ended take their first token.  ``stop_width``: a new state's stop ids per row.

        The draft's chunk reads the target's features of the same chunk and the token one
        ahead; at a row's last prompt position that token is the one just sampled, so the
        draft runs after the target's logits are in.  The state then holds, per admitted
        row, the token sampled after the prompt and the draft's logits and hidden state at
        the prompt's last position, which propose the first draft token.  No row of a
        new state is active: ``state.start_rows`` starts the rows whose prompt is in.

        Every chunk is ``[max_batch, chunk_size]``, so the rows not admitted run too: a
        running row's chunk sits at positions past its committed length (slots that a
        step writes before any query reads them), and its results are dropped.
        """
        g, rows = self.graphs, self.rows
        admitted_t = torch.tensor(list(admitted), device=self.device)
        temperature_t = torch.tensor(list(temperature), dtype=torch.float32, device=self.device)
        sampling = any(t > 0 for t, a in zip(temperature, admitted) if a)
        starts_t = torch.tensor(list(starts) if starts is not None else [0] * len(prompts), device=self.device)
        offsets = torch.where(admitted_t, starts_t, 0 if state is None else state.length + 1)
        current = q_logits = hidden = None
        if state is not None:
            current, q_logits, hidden = state.current, state.q_logits, state.hidden
        for index, chunk in enumerate(prefill_chunks(prompts, self.chunk_size, self.max_seq_len, self.device,
                                                     offsets=offsets)):
            if index == max_chunks:
                break
            last = chunk.last[:, None]
            ends = chunk.ends & admitted_t
            logits, features = self._target(g.target_prefill, chunk.tokens, chunk.positions, last)
            sampled = self.choose(logits[:, 0], temperature_t, sampling, noise)
            if self.check_ranks:
                self.check_ranks_agree(0, logits[:, 0], sampled)
            current = sampled if current is None else torch.where(ends, sampled, current)
            if self.draft is None:
                continue
            next_tokens = chunk.next_tokens.clone()
            next_tokens[rows, chunk.last] = torch.where(ends, current, next_tokens[rows, chunk.last])
            chunk_q, chunk_hidden = g.draft_forward(next_tokens, chunk.positions, features, last)
            q_logits = chunk_q[:, 0] if q_logits is None else torch.where(ends[:, None], chunk_q[:, 0], q_logits)
            hidden = chunk_hidden if hidden is None else torch.where(ends[:, None, None], chunk_hidden, hidden)
        fed = [tokens_prefilled(len(p), self.chunk_size, max_chunks) for p in prompts]
        lengths = starts_t + torch.tensor(fed, device=self.device)
        if state is None:
            active, remaining, stops = idle_state(len(prompts), self.device, stops=stop_width)
            return StepState(lengths, current, q_logits, hidden, active, temperature_t, sampling, remaining, stops)
        state.length = torch.where(admitted_t, lengths, state.length)
        state.current, state.q_logits, state.hidden = current, q_logits, hidden
        state.temperature = torch.where(admitted_t, temperature_t, state.temperature)
        return state

    def _target(self, graph, *args) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = graph(*args)
        return out if self.target_features else (out, None)

    def step(self, state: StepState, noise: Noise) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft, verify, accept, commit and draft-extend once.  Returns ``(new_tokens [B,
        k+1], accepted [B], bonus [B])``: row ``b`` emits ``new_tokens[b, :accepted[b] + 1]``,
        valid until the next step (a captured step returns its own buffers).
        The step moves ``state`` on (``state.finish_and_advance``): rows past their
        tokens, rows that met a stop id or their budget ended.

        With a ``step_graph`` the whole step is one replay; without one the calls are
        made one by one, captured or not."""
        self.verify_steps += 1
        if self.step_graph is not None:
            return self.step_graph(state, noise)
        return self.run_step(state, noise, self.graphs.parts)

    def run_step(self, state: StepState, noise: Noise,
                 parts: StepParts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's work through ``parts``, with no host sync (but the rank check's)."""
        if self.draft is None:
            outputs = self._plain_step(state, noise, parts)
        elif self.tree is not None:
            check = (lambda *a: self.check_ranks_agree(self.verify_steps, *a)) if self.check_ranks else None
            outputs = self.tree.run(state, noise, parts, check, self.graphs.tree_rule)
        else:
            outputs = self._chain_step(state, noise, parts)
        finish_and_advance(state, *outputs)
        return outputs

    def _chain_step(self, state: StepState, noise: Noise,
                    parts: StepParts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, k, rows, steps = parts, self.k, self.rows, self.steps
        q_logits, hidden = state.q_logits, state.hidden
        ids = self.draft.to_target_ids(torch.arange(q_logits.shape[-1], device=q_logits.device))
        drafts, indices, draft_probs = [], [], []
        for j in range(k):
            token, index, q = self.propose(q_logits, ids, state.temperature, state.sampling, noise)
            drafts.append(token)
            indices.append(index)
            draft_probs.append(q)
            if j < k - 1:
                step_logits, step_hidden = g.draft_step(token[:, None], (state.length + j)[:, None], hidden)
                q_logits, hidden = step_logits[:, 0], step_hidden
        drafts = torch.stack(drafts, dim=1)  # [B, k]
        verify_tokens = torch.cat([state.current[:, None], drafts], dim=1)
        verify_positions = state.length[:, None] + steps
        logits, features = g.target_verify(verify_tokens, verify_positions)
        probs, index = (torch.stack(draft_probs, 1), torch.stack(indices, 1)) if state.sampling else (None, None)
        accepted, bonus = accept_chain(logits, drafts, probs, state.temperature, noise, self.graphs.chain_rule,
                                       draft_index=index, vocab_map=ids)
        accepted = torch.where(state.active, accepted, 0)
        if self.check_ranks:
            self.check_ranks_agree(self.verify_steps, logits, drafts, accepted, bonus)
        new_tokens = torch.cat([drafts, bonus[:, None]], dim=1)
        new_tokens[rows, accepted] = bonus
        if g.commit_c is not None:
            g.commit_c(state.length, torch.where(state.active, accepted + 1, 0))
        # Draft-extend over the accepted positions: (feature_p, token_{p+1}) for p = L..L+a.
        extend_tokens = torch.where(steps[None, :] < accepted[:, None], new_tokens, bonus[:, None])
        extend_logits, extend_hidden = g.draft_step(extend_tokens, verify_positions, features, accepted[:, None])
        state.q_logits, state.hidden = extend_logits[:, 0], extend_hidden
        return new_tokens, accepted, bonus

    def _plain_step(self, state: StepState, noise: Noise,
                    parts: StepParts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """No draft: the target decodes ``current`` at ``length`` and chooses the next token."""
        logits, _ = self._target(parts.target_verify, state.current[:, None], state.length[:, None])
        bonus = self.choose(logits[:, 0], state.temperature, state.sampling, noise)
        accepted = torch.zeros_like(bonus)
        if self.check_ranks:
            self.check_ranks_agree(self.verify_steps, logits, bonus)
        if parts.commit_c is not None:
            parts.commit_c(state.length, state.active.long())
        return bonus[:, None], accepted, bonus


class SpecDecoder:
    """EAGLE / EAGLE3 speculative decoding over a DCP group, with chain or tree drafts.
    Decode with ``generate_all(decoder, prompts, max_new_tokens)``, or serve with
    ``SpecEngine(decoder)`` (both in ``runtime.engine``).

    ``k``: the draft depth (draft forwards per step; a step emits 1 to ``k + 1`` tokens).
    ``topk`` and ``draft_tokens``: an EAGLE-2 dynamic tree (``runtime.tree_step``): every
    depth expands the best ``topk`` frontier nodes by their ``topk`` likeliest tokens, and
    the target verifies the best ``draft_tokens`` nodes by cumulative draft log-prob
    (at most ``topk + (k - 1) * topk**2``; unset, ``k`` for ``topk=1`` and 16 for a
    tree, ``runtime.tree.TREE_DRAFT_TOKENS``).  ``topk=1`` (the default) is the chain.
    ``tree``: ``None`` picks the tree path for a tree shape; ``True`` runs a chain shape
    through the tree's graphs too (to compare the two paths).

    ``target``: a ``SpecTarget`` (e.g. ``Llama`` with ``aux_layers``, or ``hf.DCPCausalLM``).
    ``draft``: a ``SpecDraft`` built for it (``EagleDraft``), or ``None`` with ``k=0``: DCP
    decoding without speculation, one token per step through the same engine (the
    target needs no features then).
    ``comm``: how the target's partial attentions meet (``"ag"`` or ``"a2a"``, see
    ``dcp.backend``).  ``kernels``: the attention kernels under Inductor, ``"inline"`` or
    ``"opaque"`` (``dcp.backend``, ``ops.inlining``); unset, opaque when ``cuda_graphs``
    captures the step (an op's dispatch is then paid at capture alone) and inline otherwise.
    ``cuda_graphs``: capture the step in CUDA graphs once per shape and replay it: with
    ``step_graph`` (the default then) the whole step is one graph (``runtime.step_graph``);
    ``step_graph=False`` captures the calls (verify, commit, draft extend and step or
    depths) one by one, the glue between them uncaptured.  On a CPU group
    ``step_graph=True`` runs the step over the same static buffers, uncaptured.
    ``check_ranks``: after the prefill and every verify, compare a checksum of the merged
    logits and the accept decisions across ranks (one small eager all-gather per step)
    and raise on the first difference; a debugging aid, since ranks that disagree would
    otherwise run different numbers of steps and hang in a collective.  ``chunk_size``:
    prompt tokens per row and prefill step (default ``min(DEFAULT_CHUNK_SIZE,
    max_seq_len)``); every prompt is fed in ``[max_batch, chunk_size]`` chunks (one
    compiled graph each for the target and the draft), so a prefill's memory is bounded
    by the chunk and a new prompt width never recompiles.  ``page_size`` and
    ``kv_tokens``: the target's caches live in a pool of ``kv_tokens`` tokens over the
    group, in pages of ``page_size`` slots a rank (``dcp.prepare``); without ``kv_tokens``
    (CUDA), the pool fills ``memory_fraction`` of the device beside the weights, the draft
    and a reserve for the steps.  The engine admits a request when the pool has the pages
    it needs, and frees them as it ends.
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
        draft_tokens: int | None = None,
        tree: bool | None = None,
        temperature: float = 0.0,
        seed: int = 0,
        lowering: str = "inductor",
        comm: str = "ag",
        kernels: str | None = None,
        cuda_graphs: bool = False,
        step_graph: bool | None = None,
        check_ranks: bool = False,
        chunk_size: int | None = None,
        page_size: int = 0, kv_tokens: int | None = None, memory_fraction: float = 0.9,
    ):
        chunk_size = min(DEFAULT_CHUNK_SIZE, max_seq_len) if chunk_size is None else chunk_size
        check_chunk_size(chunk_size, max_seq_len)
        shape = spec_tree_shape(draft, k, topk, draft_tokens, tree, max_seq_len)
        if draft is not None:
            self._check_pair(target, draft)
        step_graph, kernels = self._check_options(group, temperature, kernels, cuda_graphs, step_graph, check_ranks)
        # Every argument is checked above: nothing below may fail on one, since prepare
        # changes the models for good.
        self.target, self.draft, self.group = target, draft, group
        self.k, self.temperature, self.seed = k, temperature, seed
        self.tree_shape = shape
        """The draft tree's static shape; ``None`` for a chain (or no draft)."""
        self.chunk_size = chunk_size
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.device = group.device
        self.noise = Noise(self.device, seed, rows=max_batch)
        """The sampler's generators; each ``SpecEngine`` starts them over from ``seed`` (one at a time)."""
        graphs = SpecGraphs(target, draft, group, k=k, max_batch=max_batch, max_seq_len=max_seq_len,
                            lowering=lowering, comm=comm, cuda_graphs=cuda_graphs, tree=shape, kernels=kernels,
                            page_size=page_size, kv_tokens=kv_tokens, memory_fraction=memory_fraction)
        self.graphs, self.paging = graphs, graphs.paging  # the pool's shape and block table, or None
        self.target_backend, self.verify_backend, self.draft_backend = (
            graphs.target_backend, graphs.verify_backend, graphs.draft_backend)
        self.graph_runners = graphs.graph_runners
        self.device_step = DeviceStep(graphs, group, k=k, max_batch=max_batch, max_seq_len=max_seq_len,
                                      chunk_size=chunk_size, check_ranks=check_ranks,
                                      target_vocab=target.vocab_size, draft=draft,
                                      target_features=target.feature_width > 0, tree=shape)
        if step_graph:
            self.device_step.step_graph = self._step_graph(cuda_graphs)
            self.graph_runners = [self.device_step.step_graph, *graphs.graph_runners]

    @staticmethod
    def _check_options(group, temperature, kernels, cuda_graphs, step_graph, check_ranks) -> tuple[bool, str]:
        """``step_graph`` and ``kernels`` with their defaults filled in, or ``ValueError``."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if kernels is not None and kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS} or None, got {kernels!r}")
        if cuda_graphs and group.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; this group computes on {group.device}")
        if step_graph and check_ranks:
            raise ValueError("step_graph=True and check_ranks=True: the rank check compares every step's decisions on "
                             "the host, inside the step a graph would hold; pass one of the two (check_ranks with "
                             "step_graph=None runs the calls one by one)")
        step_graph = cuda_graphs and not check_ranks if step_graph is None else step_graph
        # Captured, an opaque op's dispatch is paid once (same step time, half the compile: BENCHMARKS.md).
        return step_graph, kernels or ("opaque" if cuda_graphs else "inline")

    def _step_graph(self, capture: bool) -> StepGraph:
        """The whole step over the uncaptured compiled graphs, as one graph (``capture``)."""
        run, graphs = self.device_step.run_step, self.graphs
        return StepGraph(lambda state, noise: run(state, noise, graphs.compiled), capture=capture, pool=graphs.pool)

    @property
    def graph_count(self) -> int:
        """Graphs the backends compile for one decode: the target's prefill chunk and
        verify, and the draft's chunk, extend and then its step (a chain) or one graph
        per tree depth after the first."""
        if self.draft is None:
            return 2
        return 4 + (min(self.k - 1, 1) if self.tree_shape is None else self.k - 1)

    @staticmethod
    def _check_pair(target, draft) -> None:
        if draft.target_vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft was built for a target vocabulary of {draft.target_vocab_size} tokens but the target "
                f"has {target.vocab_size}, and no draft-to-target map covers the difference; build the draft with "
                f"DraftConfig(target.cfg, ...), or target.draft_config(...) for a DCPCausalLM (an EAGLE3 draft vocabulary maps to target ids through d2t)"
            )
        if not target.feature_width:
            raise ValueError("the target must return EAGLE features: build it with LlamaConfig(aux_layers=...), or DCPCausalLM(..., aux_layers=...)")
        if draft.feature_width != target.feature_width:
            raise ValueError(
                f"the draft reads target features {draft.feature_width} wide but the target returns "
                f"{target.feature_width}: build the draft with DraftConfig(target.cfg, ...), or target.draft_config(...) for a DCPCausalLM"
            )
