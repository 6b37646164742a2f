"""EAGLE-2 dynamic draft trees on the device: building one, accepting from it, and the
staging slots of the accepted path.

Pure torch with static shapes: every function here runs inside a compiled or captured
step (no ``.item()``, no host sync, no shape that depends on values), with the batch
dimension ``B`` first everywhere.  The shapes are fixed by a ``TreeShape``:

- ``k``: the draft depth, one draft forward per depth;
- ``topk``: the children each frontier node expands, and the size of the frontier;
- ``draft_tokens`` (``N``): the nodes the target verifies, the last accepted token (the
  root) not counted.

The draft loop calls ``expand`` once per depth; ``select`` keeps the best ``N`` of all
candidates and returns a ``Tree``.  The target verifies the root and the ``N`` nodes
(``N + 1`` new tokens, node ``j`` in staging slot ``j + 1``, the root in slot 0) under
``Tree.ancestors`` at ``Tree.positions(base)``; ``accept_greedy`` or ``accept_sampled``
walks the tree; ``commit_slots`` names the staging slots to move to their owners.

Numbering: a node is an index ``0..N-1`` into ``Tree.tokens``; ``-1`` is the root.  In the
``[N + 1]`` axes (``ancestors``, ``positions``, the target's logits, staging slots) node
``j`` sits at ``j + 1`` and the root at 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dcp_compile.runtime.sampling import Noise, exponential_draws, logprobs_at, row_temperatures, uniform_draws


TREE_DRAFT_TOKENS = 16
"""The nodes a tree verifies when the caller names only ``topk``: on the shipped pair
(BENCHMARKS.md, "Accept length of EAGLE-2 trees") 16 nodes at topk 4 are the narrowest
verify that gains 20% over the chain of the same depth, and on one H200 a 17-token verify
costs 1.05-1.27x the chain's 4 (8 layers of the 8B shape, batch 1 and 8, 8K-128K)."""


def default_draft_tokens(k: int, topk: int) -> int:
    """``draft_tokens`` when it is not given: ``k`` for the chain (``topk=1``), else
    ``TREE_DRAFT_TOKENS`` held between ``k`` and what the tree holds (a ``topk`` below 1
    gets ``k`` too, for ``TreeShape`` to refuse by name)."""
    if topk <= 1:
        return k
    return min(max(TREE_DRAFT_TOKENS, k), topk + (k - 1) * topk**2)


@dataclass(frozen=True)
class TreeShape:
    """The static shape of a draft tree; ``TreeShape(k, 1, k)`` is the chain of ``k``."""

    k: int
    """Draft depth: draft forwards per step, and the most nodes a step accepts."""
    topk: int
    """Children per expanded node, and frontier nodes expanded at every depth after the first."""
    draft_tokens: int
    """Nodes the target verifies (the root not counted): the best by cumulative draft log-prob."""

    def __post_init__(self):
        for name in ("k", "topk", "draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"TreeShape.{name} must be an int, got {type(value).__name__} {value!r}")
        if self.k < 1:
            raise ValueError(f"TreeShape: the draft depth k must be >= 1, got k={self.k}")
        if self.topk < 1:
            raise ValueError(
                f"TreeShape: topk must be >= 1, got topk={self.topk}; topk=1 with draft_tokens=k is the chain"
            )
        if self.draft_tokens < self.k:
            raise ValueError(
                f"TreeShape: draft_tokens={self.draft_tokens} is below the depth k={self.k}; a tree of depth k "
                f"verifies at least k nodes: set draft_tokens >= {self.k} or lower k"
            )
        if self.draft_tokens > self.candidates:
            raise ValueError(
                f"TreeShape: draft_tokens={self.draft_tokens} is more than a tree of depth k={self.k} and "
                f"topk={self.topk} holds (topk + (k - 1) * topk**2 = {self.candidates} candidates): set "
                f"draft_tokens <= {self.candidates}, or raise topk or k"
            )

    @property
    def candidates(self) -> int:
        """Nodes the draft proposes over all depths: ``topk`` at depth 1, ``topk**2`` after."""
        return self.topk + (self.k - 1) * self.topk**2

    @property
    def tree_slots(self) -> int:
        """Draft cache slots the drafting keeps nodes in: the frontier of every depth
        but the last (``runtime.tree_step``)."""
        return (self.k - 1) * self.topk

    @property
    def verify_tokens(self) -> int:
        """New tokens of a verify step (and staging slots it needs): the root and the nodes."""
        return self.draft_tokens + 1


class Expansion(NamedTuple):
    """One depth's candidates, ``C = F * topk`` of them for ``F`` expanded nodes."""

    tokens: torch.Tensor
    """``[B, C]`` the candidates' tokens (indices into the draft's log-prob axis)."""
    parents: torch.Tensor
    """``[B, C]`` which of the ``F`` expanded (frontier) nodes each candidate extends."""
    scores: torch.Tensor
    """``[B, C]`` cumulative draft log-probs: the parent's score plus the token's log-prob."""
    frontier: torch.Tensor
    """``[B, topk]`` the candidates the next depth expands (indices into ``C``), best first."""


def expand(frontier_scores: torch.Tensor, draft_logprobs: torch.Tensor, topk: int) -> Expansion:
    """One depth of EAGLE-2's drafting: each of the ``F`` frontier nodes proposes its
    ``topk`` most likely tokens, and the best ``topk`` of those ``F * topk`` candidates (by
    cumulative log-prob) form the next frontier.

    ``frontier_scores [B, F]``: the frontier's cumulative log-probs (zeros ``[B, 1]`` at
    depth 1, the root); ``draft_logprobs [B, F, V]``: the draft's log-probs after each
    frontier node.  Feed the next depth the tokens ``tokens.gather(1, frontier)`` and the
    scores ``scores.gather(1, frontier)``.
    """
    B, F, V = draft_logprobs.shape
    if frontier_scores.shape != (B, F):
        raise ValueError(f"expand: frontier_scores must be [B, F] = {[B, F]} to match draft_logprobs "
                         f"[B, F, V] = {[B, F, V]}, got {list(frontier_scores.shape)}")
    if topk > V:
        raise ValueError(f"expand: topk={topk} children per node needs a vocabulary of at least {topk}, got V={V}")
    logprobs, tokens = torch.topk(draft_logprobs.float(), topk, dim=-1)  # [B, F, topk]
    # A child never scores above its parent (log-probs <= 0), so the best N of all
    # candidates is ancestor-closed; the clamp keeps that true for any input.
    scores = torch.minimum(frontier_scores.float()[..., None] + logprobs, frontier_scores.float()[..., None])
    parents = torch.arange(F, device=tokens.device).view(1, F, 1).expand(B, F, topk)
    scores = scores.reshape(B, F * topk)
    frontier = _best(scores)[:, :topk]
    return Expansion(tokens.reshape(B, F * topk), parents.reshape(B, F * topk), scores, frontier)


def _best(scores: torch.Tensor) -> torch.Tensor:
    """Indices ordering ``scores [B, C]`` best first, ties to the lower index: a parent
    (lower index, score at least its child's) always comes before its children."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices


@dataclass(frozen=True)
class Tree:
    """The verified tree, per batch row: ``N`` nodes in topological order (by depth,
    then by score), so a parent comes before its children."""

    shape: TreeShape
    """The static shape the tree was built for; ``N = shape.draft_tokens``."""
    tokens: torch.Tensor
    """``[B, N]`` each node's token."""
    parents: torch.Tensor
    """``[B, N]`` each node's parent (a node index), -1 for the root's children."""
    depth: torch.Tensor
    """``[B, N]`` each node's depth, 1 for the root's children."""
    scores: torch.Tensor
    """``[B, N]`` each node's cumulative draft log-prob."""
    ancestors: torch.Tensor
    """``[B, N+1, N+1]`` bool: ``[b, i, j]`` when ``j`` is ``i`` or an ancestor of ``i``
    (index 0 the root, node ``j`` at ``j + 1``): the verify window's attention mask."""

    def positions(self, base: torch.Tensor) -> torch.Tensor:
        """``[B, N+1]`` the positions of the root and the nodes: ``base [B]`` (the root's
        position, the last accepted token's) plus depth."""
        depth = torch.cat([torch.zeros_like(self.depth[:, :1]), self.depth], dim=1)
        return base[:, None] + depth

    def children(self) -> torch.Tensor:
        """``[B, N+1, topk]`` the children (node indices) of the root and of every node,
        in node order, padded with -1."""
        B, N = self.tokens.shape
        slot = self.parents + 1  # [B, N] the parent's index on the [N+1] axis
        # A node's rank among its siblings: the earlier nodes with the same parent.
        earlier = torch.ones(N, N, dtype=torch.bool, device=slot.device).tril(-1)
        rank = ((slot[:, :, None] == slot[:, None, :]) & earlier).sum(-1)  # [B, N]
        # The selected nodes have at most topk children; a slot past it is dropped.
        width = self.shape.topk
        flat = torch.where(rank < width, slot * width + rank, (N + 1) * width)
        table = torch.full((B, (N + 1) * width + 1), -1, dtype=torch.long, device=slot.device)
        nodes = torch.arange(N, device=slot.device).expand(B, N)
        table = table.scatter(1, flat, nodes)
        return table[:, :-1].view(B, N + 1, width)


def select(shape: TreeShape, expansions: Sequence[Expansion]) -> Tree:
    """The tree the target verifies: the best ``draft_tokens`` of all candidates of the
    ``k`` expansions, by cumulative draft log-prob.

    Candidates are numbered depth by depth, so a parent's number is below its child's;
    ranking by score with ties to the lower number puts every parent before its children
    (a child's score is at most its parent's), so the kept set is ancestor-closed.
    """
    if len(expansions) != shape.k:
        raise ValueError(f"select: a tree of depth k={shape.k} takes {shape.k} expansions, got {len(expansions)}")
    tokens = torch.cat([e.tokens for e in expansions], dim=1)  # [B, C]
    scores = torch.cat([e.scores for e in expansions], dim=1)
    B, C = tokens.shape
    device = tokens.device
    parents, depths, offset = [], [], 0
    for d, e in enumerate(expansions, start=1):
        width = shape.topk if d == 1 else shape.topk**2
        if e.tokens.shape[1] != width:
            raise ValueError(f"select: depth {d} of {shape} has {width} candidates, got {e.tokens.shape[1]}: "
                             f"expand depth 1 from the root alone and every later depth from the topk frontier")
        if d == 1:
            parents.append(torch.full_like(e.parents, -1))
        else:
            previous = expansions[d - 2]
            # A frontier node's candidate number: its index in the previous depth, plus offset.
            parents.append(offset - previous.tokens.shape[1] + previous.frontier.gather(1, e.parents))
        depths.append(torch.full_like(e.parents, d))
        offset += e.tokens.shape[1]
    parents_c, depth_c = torch.cat(parents, dim=1), torch.cat(depths, dim=1)

    N = shape.draft_tokens
    kept = _best(scores)[:, :N]  # [B, N] candidate numbers, best first
    # Topological order: by depth, then by score (the stable sort keeps the ranking).
    kept = kept.gather(1, torch.sort(depth_c.gather(1, kept), dim=1, stable=True).indices)
    node_of = torch.full((B, C), -1, dtype=torch.long, device=device)
    node_of = node_of.scatter(1, kept, torch.arange(N, device=device).expand(B, N))
    parent_c = parents_c.gather(1, kept)
    parents_n = torch.where(parent_c >= 0, node_of.gather(1, parent_c.clamp(min=0)), -1)
    depth_n = depth_c.gather(1, kept)
    return Tree(shape, tokens.gather(1, kept), parents_n, depth_n, scores.gather(1, kept),
                _ancestors(parents_n, shape.k))


def _ancestors(parents: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, N+1, N+1]`` ancestor-or-self mask from ``parents [B, N]``: ``k`` steps up
    reach the root from any node (depth <= k)."""
    B, N = parents.shape
    up = torch.cat([torch.zeros_like(parents[:, :1]), parents + 1], dim=1)  # [B, N+1], root -> root
    at = torch.arange(N + 1, device=parents.device).expand(B, N + 1)
    mask = torch.eye(N + 1, dtype=torch.bool, device=parents.device).expand(B, N + 1, N + 1).clone()
    for _ in range(k):
        at = up.gather(1, at)
        mask = mask.scatter(2, at[..., None], True)
    return mask


class Accepted(NamedTuple):
    """What a verify step accepts from a tree."""

    count: torch.Tensor
    """``[B]`` nodes accepted, 0..k; the step emits ``count + 1`` tokens."""
    nodes: torch.Tensor
    """``[B, k]`` the accepted path, root side first (node indices), padded with -1."""
    bonus: torch.Tensor
    """``[B]`` the token after the accepted path."""


def accept_greedy(tree: Tree, target_logits: torch.Tensor) -> Accepted:
    """Follow the target's argmax down the tree: from the root, move to the child whose
    token is the target's argmax at the current node while there is one; the bonus is the
    argmax at the last node reached.

    ``target_logits [B, N+1, V]``: the target's logits after the root and each node.
    Siblings hold distinct tokens, so at most one child matches (the first, if not).
    """
    B = tree.tokens.shape[0]
    greedy = target_logits.argmax(-1)  # [B, N+1]
    # A node matches when its token is the target's argmax at its parent.
    match = tree.tokens == greedy.gather(1, tree.parents + 1)  # [B, N]
    at = torch.zeros(B, dtype=torch.long, device=greedy.device)  # current node on the [N+1] axis
    alive = torch.ones(B, dtype=torch.bool, device=greedy.device)
    nodes = []
    for _ in range(tree.shape.k):
        hit = match & (tree.parents + 1 == at[:, None])
        alive = alive & hit.any(-1)
        node = hit.int().argmax(-1)
        at = torch.where(alive, node + 1, at)
        nodes.append(torch.where(alive, node, -1))
    nodes = torch.stack(nodes, dim=1)
    return Accepted((nodes >= 0).sum(-1), nodes, greedy.gather(1, at[:, None])[:, 0])


class TreeDraws(NamedTuple):
    """The random numbers of one sampled acceptance, drawn before it (all ranks alike)."""

    uniforms: torch.Tensor
    """``[B, k, topk]`` U[0, 1): one per child tried at each depth."""
    clocks: torch.Tensor
    """``[B, V]`` Exponential(1): the token after the path is ``argmax(weights / clocks)``."""


def draw(noise: Noise | torch.Generator | None, B: int, shape: TreeShape, vocab: int, device) -> TreeDraws:
    """The draws of one sampled acceptance from the sampler's generators: uniforms first,
    then the clocks."""
    uniforms = uniform_draws(noise, (B, shape.k, shape.topk), device)
    return TreeDraws(uniforms, exponential_draws(noise, torch.empty(B, vocab, device=device)))


class _Left(NamedTuple):
    """What is left of the target's distribution ``p`` at the current node after its
    rejected children, without materializing ``p``: the mass still in it (1 at a fresh
    node) and the tokens removed from it (``[B, topk]``, -1 where none)."""

    mass: torch.Tensor
    removed: torch.Tensor


def _reject(left: _Left, token: torch.Tensor, p_token: torch.Tensor, rejected: torch.Tensor, slot: int) -> _Left:
    """The residual after rejecting ``token [B]`` (probability ``p_token [B]``) drafted
    with certainty, in the rows ``rejected [B]``: ``max(p - onehot(token), 0)`` is ``p``
    with ``token`` removed (unnormalized), so its mass leaves the total; ``slot`` is the
    child's place among its siblings."""
    removed = left.removed.clone()
    removed[:, slot] = torch.where(rejected, token, left.removed[:, slot])
    return _Left(torch.where(rejected, left.mass - p_token, left.mass), removed)


def accept_sampled(
    tree: Tree,
    target_logits: torch.Tensor,
    temperature: float | torch.Tensor,
    noise: Noise | torch.Generator | TreeDraws | None,
) -> Accepted:
    """Multi-draft speculative sampling down the tree, so that the emitted tokens are
    distributed exactly as the target's own samples.

    At the current node, with target distribution ``p`` there, try its children
    ``x_1, x_2, ...`` in node order: accept ``x_i`` with probability ``p(x_i) / sum(p)``
    and move to it (``p`` becomes the target's distribution there); on rejection remove
    ``x_i`` from ``p``.  If every child is rejected, or the node has none, the bonus is
    drawn from what is left of ``p``.

    Why exactly the target.  SpecInfer's rule for candidates ``x_i ~ q_i`` (``q_i``
    conditioned on the earlier candidates) accepts ``x_i`` with ``min(1, p_i(x_i) /
    q_i(x_i))`` and on rejection continues with ``p_{i+1} = norm(max(p_i - q_i, 0))``;
    each step emits ``min(p_i, q_i)`` and leaves ``max(p_i - q_i, 0)``, which sum to
    ``p_i``, so by induction over the siblings the node emits ``p_1 = p``.  A top-k tree
    is not sampled: ``x_i`` is a function of the context, so ``q_i`` is the point mass
    at ``x_i``, not the draft's softmax.  Then ``min(1, p_i(x_i) / 1) = p_i(x_i)`` and
    ``max(p_i - onehot(x_i), 0)`` is ``p_i`` with ``x_i`` zeroed: EAGLE's
    ``evaluate_posterior`` (``qx = 1``; ``gtp[xi] = 0``, renormalized).  Using the draft's
    softmax for ``q`` instead would be biased, e.g. a single child with ``p = 0.6`` and
    ``q = 0.5`` would be emitted always.  Accepting ``x_i`` moves to the target's
    conditional after it and the same argument repeats a depth down, so the path and the
    bonus are a sample of the target's autoregressive distribution.  Nothing of the tree
    may depend on these draws; it does not (it is built from the draft's log-probs).

    ``target_logits [B, N+1, V]`` as for ``accept_greedy``; ``temperature`` one for the
    batch or ``[B]`` per row (0: that row is greedy); ``noise`` the sampler's generators
    (``draw`` is called) or the draws themselves.  ``tree.tokens`` must index ``V``.
    """
    if not isinstance(temperature, torch.Tensor) and temperature == 0:
        return accept_greedy(tree, target_logits)
    B = tree.tokens.shape[0]
    draws = noise if isinstance(noise, TreeDraws) else draw(noise, B, tree.shape, target_logits.shape[-1],
                                                            target_logits.device)
    divisor, sampled_rows = row_temperatures(temperature, target_logits)
    # The walk reads p at the children's tokens alone; p is materialized once, at the
    # node the path ends on, for the bonus.
    logp = logprobs_at(target_logits, divisor)  # [B, N+1, V]
    nodes, left, at = _walk_sampled(tree, logp, draws)
    rows = torch.arange(B, device=logp.device)
    p = logp[rows, at].exp()  # [B, V] at the last node
    removed = torch.zeros_like(p, dtype=torch.int32).scatter_add_(
        1, left.removed.clamp(min=0), (left.removed >= 0).int()) > 0
    weights = p.masked_fill(removed, 0.0)
    # A rejected child carries all that is left of p only through rounding; keep p then.
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, p)
    sampled = Accepted((nodes >= 0).sum(-1), nodes, (weights / draws.clocks).argmax(-1))
    if sampled_rows is None:
        return sampled
    greedy = accept_greedy(tree, target_logits)
    rows = sampled_rows[:, None]
    return Accepted(torch.where(sampled_rows, sampled.count, greedy.count), torch.where(rows, sampled.nodes, greedy.nodes),
                    torch.where(sampled_rows, sampled.bonus, greedy.bonus))


def _walk_sampled(tree: Tree, logp: torch.Tensor, draws: TreeDraws):
    """``accept_sampled``'s walk from the root over the target's tempered log-probs
    ``logp [B, N+1, V]``: ``(nodes [B, k], left, at [B])``, the accepted nodes (-1 past
    the path), what is left of ``p`` at the last node, and that node (0: the root)."""
    B = logp.shape[0]
    k, topk = tree.shape.k, tree.shape.topk
    children = tree.children()  # [B, N+1, topk]
    rows = torch.arange(B, device=logp.device)
    at = torch.zeros(B, dtype=torch.long, device=logp.device)
    fresh = _Left(torch.ones(B, device=logp.device), torch.full((B, topk), -1, device=logp.device))
    left = fresh
    alive = torch.ones(B, dtype=torch.bool, device=logp.device)
    nodes = []
    for depth in range(k):
        took, chosen, left = _try_children(tree, children[rows, at], lambda token: logp[rows, at, token].exp(), left,
                                           alive, draws.uniforms[:, depth])
        alive = took
        at = torch.where(took, chosen + 1, at)
        left = _Left(torch.where(took, fresh.mass, left.mass), torch.where(took[:, None], fresh.removed, left.removed))
        nodes.append(torch.where(took, chosen, -1))
    return torch.stack(nodes, dim=1), left, at


def _try_children(tree: Tree, tried: torch.Tensor, p_of, left: _Left, alive: torch.Tensor, uniforms: torch.Tensor):
    """One depth of ``accept_sampled``: the children ``tried [B, topk]`` of each row's
    node in turn (``p_of(tokens [B]) -> [B]``: the target's probabilities there), each
    accepted with ``p(x) / sum(p)`` or removed from ``p``.  Returns ``(took [B], chosen
    [B], left)``."""
    took = torch.zeros_like(alive)
    chosen = torch.zeros_like(tried[:, 0])
    for i in range(tried.shape[1]):
        child = tried[:, i]
        live = alive & ~took & (child >= 0)
        token = tree.tokens.gather(1, child.clamp(min=0)[:, None])[:, 0]  # [B]
        p_token = p_of(token)
        # Accept with p(x) / sum(p): p stays unnormalized after removals (siblings differ,
        # so x is still in it).
        ok = live & (uniforms[:, i] * left.mass < p_token)
        took, chosen = took | ok, torch.where(ok, child, chosen)
        left = _reject(left, token, p_token, live & ~ok, i)
    return took, chosen, left


def emitted(tree: Tree, accepted: Accepted) -> torch.Tensor:
    """``[B, k+1]`` the tokens a step emits: the accepted path's tokens, then the bonus at
    ``count``; row ``b`` emits ``[:count[b] + 1]`` (the bonus pads the rest)."""
    path = tree.tokens.gather(1, accepted.nodes.clamp(min=0))
    path = torch.where(accepted.nodes >= 0, path, accepted.bonus[:, None])
    return torch.cat([path, accepted.bonus[:, None]], dim=1)


def commit_slots(accepted: Accepted) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots [B, k+1], valid [B, k+1])``: the staging slots (of the verify step's
    ``N + 1`` new tokens) whose K/V the commit moves, in order, to the owner slots of
    positions ``base, base + 1, ...``: the root's slot 0, then ``node + 1`` along the
    accepted path.  ``valid`` holds for the first ``count + 1``; padded entries repeat
    the last accepted slot, so a gather stays in range."""
    k = accepted.nodes.shape[1]
    slots = torch.cat([torch.zeros_like(accepted.nodes[:, :1]), accepted.nodes + 1], dim=1)  # [B, k+1]
    valid = torch.arange(k + 1, device=slots.device)[None, :] <= accepted.count[:, None]
    last = slots.gather(1, accepted.count[:, None])
    return torch.where(valid, slots, last), valid


def spec_tree_shape(draft, k, topk, draft_tokens, tree, max_seq_len) -> TreeShape | None:
    """``SpecDecoder``'s draft tree shape, or ``None`` for a chain (or no draft); refuses a
    bad one by name."""
    if draft is None:
        if k != 0 or topk != 1 or draft_tokens not in (None, 0) or tree:
            raise ValueError(f"k={k!r}, topk={topk!r}, draft_tokens={draft_tokens!r} and tree={tree!r} ask for "
                             f"draft tokens, which need a draft; without one (draft=None) pass k=0 alone")
        return None
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (the draft depth: draft tokens per step for a chain) must be an int >= 1, got {k!r}")
    # TreeShape refuses a shape no tree has.
    shape = TreeShape(k, topk, default_draft_tokens(k, topk) if draft_tokens is None else draft_tokens)
    chain = topk == 1 and shape.draft_tokens == k
    if tree is False and not chain:
        raise ValueError(f"tree=False asks for a chain, but topk={topk} and draft_tokens={shape.draft_tokens} "
                         f"describe a tree; a chain is topk=1, draft_tokens=k={k}")
    if chain and not tree:
        return None
    if shape.verify_tokens > max_seq_len:
        raise ValueError(
            f"a tree of draft_tokens={shape.draft_tokens} verifies {shape.verify_tokens} new tokens per step, more "
            f"than a cache of max_seq_len={max_seq_len} holds: lower draft_tokens or raise max_seq_len")
    return shape
