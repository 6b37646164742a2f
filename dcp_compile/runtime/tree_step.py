"""One speculative step with an EAGLE-2 dynamic draft tree, for every row at once.

1. Draft the tree (``draft``): depth 1 is the ``topk`` best tokens of the draft's
   logits after the last accepted token; every later depth runs the draft once over the
   ``topk`` frontier nodes and keeps the best ``topk`` of their ``topk**2`` children
   (``tree.expand``).  The tree is the best ``draft_tokens`` nodes of all depths
   (``tree.select``).
2. Verify the root (the last emitted token) and the nodes with the target in one
   graph, each node attending to the cached prefix, its ancestors and itself
   (``ops.tree_mask``: the ancestor mask reaches the window attentions the passes
   insert); the new K/V wait in staging slots, on a group of one too (siblings share a
   position).
3. Accept (``tree.accept_greedy``, or ``tree.accept_sampled`` where a row samples), move
   the accepted path's K/V from its staging slots to their owners (``KVCommit`` with a
   path), and draft-extend over the path, as the chain does.

How a depth attends.  The draft's cache holds the committed positions (below the root's
position ``L``); a depth-``d`` frontier node must also see its ``d - 1`` ancestors,
which sit at positions ``L..L+d-2`` beside their cousins.  So every depth's frontier
nodes keep their keys and values in the draft's tree slots (``prepare(...,
tree_slots=(k - 1) * topk)``, past the cache's ``max_seq_len``; depth ``d``'s node ``i``
at tree slot ``(d - 1) * topk + i``), and the depth-``d`` call brings only its ``topk``
nodes, attending to the cache up to ``L``, to the tree slots of the earlier depths under
an ancestor mask, and to itself (``TreeCall(draft, staged=True)``).  A depth reads the
cache once and computes ``topk`` tokens, as a chain step computes one; the next
draft-extend writes the accepted path to its owner slots, and the tree slots are
rewritten by the next step's tree before anything reads them.

Static shapes per ``TreeShape``: one verify graph, one draft graph per depth after the
first, the chain's extend and commit; every mask is built on the device.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dcp_compile.runtime.sampling import Noise
from dcp_compile.runtime.tree import (
    Tree,
    TreeShape,
    accept_greedy,
    accept_sampled,
    commit_slots,
    draw,
    emitted,
    expand,
    select,
)


class TreeStep:
    """Drafts, verifies, accepts and commits a tree; ``DeviceStep.run_step`` calls ``run``
    with the step's ``parts`` (a ``spec.StepParts`` built with this shape: the tree's
    verify and ``draft_tree``)."""

    def __init__(self, shape: TreeShape, *, draft, max_batch: int, device):
        self.shape, self.draft = shape, draft
        k, topk = shape.k, shape.topk
        self.steps = torch.arange(k + 1, device=device)
        # A depth's nodes see themselves among the new tokens; their ancestors' tree
        # slots are scattered in beside that, per depth (index d: the depth-d call).
        self.own = torch.eye(topk, dtype=torch.bool, device=device).expand(max_batch, topk, topk)
        self.earlier = [None] + [torch.zeros(max_batch, topk, (d - 1) * topk, dtype=torch.bool, device=device)
                                 for d in range(1, k)]

    def draft_tree(self, draft_tree: list, length: torch.Tensor, q_logits: torch.Tensor, hidden: torch.Tensor) -> Tree:
        """The tree for rows whose root sits at ``length [B]``, from the draft's logits
        ``q_logits [B, V_draft]`` after the root and the hidden state ``hidden [B, 1, H]``
        they came with, through ``draft_tree`` (the depths' calls); its tokens are target ids."""
        shape, topk, to_target = self.shape, self.shape.topk, self.draft.to_target_ids
        B, H = hidden.shape[0], hidden.shape[-1]
        level = expand(torch.zeros(B, 1, device=q_logits.device), torch.log_softmax(q_logits.float(), -1)[:, None], topk)
        levels = [level]
        features = hidden.expand(B, topk, H)  # each frontier node's parent's hidden state
        path = self.earlier[1][:B].long()  # [B, topk, d - 1] the tree slots of each node's ancestors
        for d in range(1, shape.k):
            tokens = to_target(level.tokens.gather(1, level.frontier))
            positions = (length + (d - 1))[:, None].expand(B, topk)
            ancestors = torch.cat([self.earlier[d][:B].scatter(2, path, True), self.own[:B]], dim=2)
            logits, out = draft_tree[d - 1](tokens, positions, ancestors, length, features)
            scores = level.scores.gather(1, level.frontier)
            level = expand(scores, torch.log_softmax(logits.float(), -1), topk)
            levels.append(level)
            parent = level.parents.gather(1, level.frontier)  # [B, topk]: which of this depth's nodes each extends
            path = torch.cat([path.gather(1, parent[..., None].expand(B, topk, d - 1)), (parent + (d - 1) * topk)[..., None]], 2)
            features = out.gather(1, parent[..., None].expand(B, topk, H))
        tree = select(shape, levels)
        return replace(tree, tokens=to_target(tree.tokens))

    def run(self, state, noise: Noise, parts, check=None,
            rule=accept_sampled) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(new_tokens [B, k+1], accepted [B], bonus [B])`` as ``DeviceStep.step``
        returns them; ``check(logits, *decisions)``: the rank check, if any; ``rule``: the
        sampled acceptance over draws made beforehand (``accept_sampled``, or it compiled)."""
        g = parts
        tree = self.draft_tree(parts.draft_tree, state.length, state.q_logits, state.hidden)
        tokens = torch.cat([state.current[:, None], tree.tokens], dim=1)
        logits, features = g.target_verify(tokens, tree.positions(state.length), tree.ancestors)
        if state.sampling:
            draws = draw(noise, tree.tokens.shape[0], self.shape, logits.shape[-1], logits.device)
            accepted = rule(tree, logits, state.temperature, draws)
        else:
            accepted = accept_greedy(tree, logits)
        count = torch.where(state.active, accepted.count, 0)
        if check is not None:
            check(logits, tree.tokens, count, accepted.bonus)
        new_tokens = emitted(tree, accepted)
        slots, _ = commit_slots(accepted)
        g.commit_c(state.length, torch.where(state.active, count + 1, 0), slots)
        # Draft-extend over the accepted path: (feature_p, token_{p+1}) for p = L..L+count.
        path_features = features.gather(1, slots[..., None].expand(-1, -1, features.shape[-1]))
        positions = state.length[:, None] + self.steps
        extend_logits, extend_hidden = g.draft_step(new_tokens, positions, path_features, count[:, None])
        state.q_logits, state.hidden = extend_logits[:, 0], extend_hidden
        return new_tokens, count, accepted.bonus
