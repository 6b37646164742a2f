"""EAGLE-2 draft trees on the device: shape checks, building, greedy and sampled
acceptance, commit slots (single process, CPU)."""

import itertools

import pytest
import torch

from dcp_compile.runtime import tree as tree_mod
from dcp_compile.runtime.sampling import Noise, accept_chain
from dcp_compile.runtime.tree import (
    Accepted,
    TreeDraws,
    TreeShape,
    default_draft_tokens,
    accept_greedy,
    accept_sampled,
    commit_slots,
    draw,
    emitted,
    expand,
    select,
)

P_VALUE = 1e-3


def build(shape: TreeShape, draft_logprobs_at):
    """Draft a tree depth by depth.  ``draft_logprobs_at(depth, parent_tokens [B, F] or
    None) -> [B, F, V]`` stands in for the draft's forward at the frontier."""
    frontier_tokens, frontier_scores, expansions = None, None, []
    for d in range(1, shape.k + 1):
        logprobs = draft_logprobs_at(d, frontier_tokens)
        if frontier_scores is None:
            frontier_scores = torch.zeros(logprobs.shape[0], 1)
        e = expand(frontier_scores, logprobs, shape.topk)
        expansions.append(e)
        frontier_tokens, frontier_scores = e.tokens.gather(1, e.frontier), e.scores.gather(1, e.frontier)
    return select(shape, expansions)


def random_tree(shape: TreeShape, B: int, V: int, gen: torch.Generator, scale: float = 2.0):
    def logprobs_at(d, tokens):
        F = 1 if tokens is None else tokens.shape[1]
        return torch.log_softmax(scale * torch.randn(B, F, V, generator=gen), -1)

    return build(shape, logprobs_at)


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test, cells with expected count below 5 pooled into one."""
    observed, expected = observed.double().flatten(), expected.double().flatten()
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(observed.numel() - 1, dtype=torch.float64)
    return torch.special.gammaincc(df / 2, stat / 2).item()


# ---- TreeShape -------------------------------------------------------------------------------


@pytest.mark.parametrize("k, topk, draft_tokens, match", [
    (0, 1, 1, "depth k must be >= 1"),
    (3, 0, 3, "topk must be >= 1"),
    (4, 2, 3, "below the depth k=4"),
    (2, 2, 7, r"topk \+ \(k - 1\) \* topk\*\*2 = 6"),
    (3, 1, 4, "holds"),
])
def test_shape_refuses(k, topk, draft_tokens, match):
    with pytest.raises(ValueError, match=match):
        TreeShape(k, topk, draft_tokens)


def test_shape_refuses_non_int():
    with pytest.raises(TypeError, match="must be an int"):
        TreeShape(3, 2.0, 4)


@pytest.mark.parametrize("k, topk, expected", [
    (4, 1, 4),     # the chain verifies its k drafts
    (6, 4, 16),    # a tree verifies TREE_DRAFT_TOKENS nodes
    (2, 2, 6),     # ... or all it holds: 2 + 1 * 4
    (20, 2, 20),   # ... and never fewer than its depth
])
def test_default_draft_tokens(k, topk, expected):
    assert default_draft_tokens(k, topk) == expected
    TreeShape(k, topk, expected)  # always a shape the tree holds


def test_shape_limits():
    assert TreeShape(5, 4, 5 * 16 - 12).candidates == 4 + 4 * 16
    assert TreeShape(5, 4, 68).verify_tokens == 69
    assert TreeShape(3, 1, 3).candidates == 3


# ---- building ---------------------------------------------------------------------------------


def test_topk_one_is_the_chain():
    B, V, k = 16, 11, 4
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(B, k, V, generator=gen)
    tree = build(TreeShape(k, 1, k), lambda d, _: torch.log_softmax(logits[:, d - 1 : d], -1))
    assert torch.equal(tree.tokens, logits.argmax(-1))
    assert tree.parents.tolist() == [list(range(-1, k - 1))] * B
    assert tree.depth.tolist() == [list(range(1, k + 1))] * B
    assert torch.equal(tree.ancestors, torch.ones(B, k + 1, k + 1, dtype=torch.bool).tril())
    base = torch.arange(B) * 7
    assert torch.equal(tree.positions(base), base[:, None] + torch.arange(k + 1))

    # Greedy acceptance is the chain's, on the same target logits.
    target = torch.randn(B, k + 1, V, generator=gen)
    # Make the target agree with the chain for a row-dependent number of tokens.
    agree = torch.arange(B) % (k + 1)
    for b in range(B):
        target[b, : agree[b]].scatter_(1, tree.tokens[b, : agree[b], None], 9.0)
        if agree[b] < k:
            target[b, agree[b], tree.tokens[b, agree[b]]] = -9.0
    chain_count, chain_bonus = accept_chain(target, tree.tokens, None, 0.0, None)
    got = accept_greedy(tree, target)
    assert torch.equal(got.count, chain_count) and torch.equal(got.bonus, chain_bonus)
    assert torch.equal(got.count, agree)
    steps = torch.arange(k)
    assert torch.equal(got.nodes, torch.where(steps < got.count[:, None], steps, -1))


def test_topk_one_sampled_is_the_chain_rule_with_certain_drafts():
    """With ``q`` the point mass at each draft, the chain's rejection sampling is the
    tree's rule, draw for draw."""
    B, V, k = 512, 7, 3
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(B, k, V, generator=gen)
    tree = build(TreeShape(k, 1, k), lambda d, _: torch.log_softmax(logits[:, d - 1 : d], -1))
    target = torch.randn(B, k + 1, V, generator=gen)
    # Half the rows: the target likes the chain's tokens, so paths run deep.
    target[: B // 2, :k].scatter_add_(2, tree.tokens[: B // 2, :, None], torch.full((B // 2, k, 1), 2.0))
    certain = torch.nn.functional.one_hot(tree.tokens, V).float()
    chain_count, chain_bonus = accept_chain(target, tree.tokens, certain, 0.8, torch.Generator().manual_seed(9))
    got = accept_sampled(tree, target, 0.8, torch.Generator().manual_seed(9))
    assert torch.equal(got.count, chain_count) and torch.equal(got.bonus, chain_bonus)
    assert set(got.count.tolist()) == set(range(k + 1))


def reference_eagle2(shape: TreeShape, logprobs_at_path):
    """EAGLE-2's drafting in plain Python for one row: returns the kept nodes as token
    paths.  ``logprobs_at_path(path) -> [V]`` is the draft after ``path``."""
    frontier = [((), 0.0)]
    candidates = []
    for d in range(shape.k):
        layer = []
        for path, score in frontier:
            lp = logprobs_at_path(path)
            for token in torch.topk(lp, shape.topk).indices.tolist():
                layer.append((path + (token,), score + lp[token].item()))
        candidates += layer
        frontier = sorted(layer, key=lambda c: -c[1])[: shape.topk]
    kept = sorted(candidates, key=lambda c: -c[1])[: shape.draft_tokens]
    return {path for path, _ in kept}


def paths_of(tree, b):
    tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()

    def path(j):
        return (path(parents[j]) if parents[j] >= 0 else ()) + (tokens[j],)

    return {path(j) for j in range(len(tokens))}


@pytest.mark.parametrize("shape", [TreeShape(3, 2, 7), TreeShape(4, 3, 12), TreeShape(2, 4, 20)])
def test_select_is_eagle2s_tree(shape):
    """The kept nodes are the reference algorithm's, for a draft whose log-probs depend
    on the whole path (continuous, so no ties)."""
    B, V = 6, 9
    table = {}
    gen = torch.Generator().manual_seed(5)

    def at_path(b, path):
        if (b, path) not in table:
            table[b, path] = torch.log_softmax(2 * torch.randn(V, generator=gen, dtype=torch.float64), -1).float()
        return table[b, path]

    # Drive expand directly so the frontier's paths are known.
    expansions, frontier_paths = [], [[()] for _ in range(B)]
    scores = torch.zeros(B, 1)
    for d in range(shape.k):
        lp = torch.stack([torch.stack([at_path(b, p) for p in frontier_paths[b]]) for b in range(B)])
        e = expand(scores, lp, shape.topk)
        expansions.append(e)
        cand_paths = [[frontier_paths[b][f] + (t,) for f, t in zip(e.parents[b].tolist(), e.tokens[b].tolist())]
                      for b in range(B)]
        frontier_paths = [[cand_paths[b][i] for i in e.frontier[b].tolist()] for b in range(B)]
        scores = e.scores.gather(1, e.frontier)
    tree = select(shape, expansions)
    for b in range(B):
        assert paths_of(tree, b) == reference_eagle2(shape, lambda p, b=b: at_path(b, p))


def check_well_formed(tree):
    B, N = tree.tokens.shape
    for b in range(B):
        parents, depth = tree.parents[b].tolist(), tree.depth[b].tolist()
        siblings = {}
        for j, parent in enumerate(parents):
            # Topological, and closed: the parent is kept, and comes first.
            assert -1 <= parent < j
            assert depth[j] == (1 if parent < 0 else depth[parent] + 1)
            assert depth[j] <= tree.shape.k
            siblings.setdefault(parent, []).append(tree.tokens[b, j].item())
            if parent >= 0:
                assert tree.scores[b, j] <= tree.scores[b, parent]
        assert all(len(set(s)) == len(s) <= tree.shape.topk for s in siblings.values())
        assert depth == sorted(depth)
        # The mask: a node sees itself and its ancestors, the root sees only itself.
        expected = torch.eye(N + 1, dtype=torch.bool)
        for j in range(N):
            i = j
            while i >= 0:
                expected[j + 1, i + 1] = True
                i = parents[i]
            expected[j + 1, 0] = True
        assert torch.equal(tree.ancestors[b], expected)


@pytest.mark.parametrize("shape", [TreeShape(3, 2, 7), TreeShape(4, 3, 20), TreeShape(5, 4, 68), TreeShape(6, 2, 6)])
@pytest.mark.parametrize("draft", ["random", "uniform", "certain"])
def test_select_is_ancestor_closed_and_topological(shape, draft):
    """On random log-probs, and on the two kinds of ties: a uniform draft (every
    sibling ties) and a certain one (log-prob 0: a child ties its parent)."""
    B, V = 8, 10
    gen = torch.Generator().manual_seed(6)

    def logprobs_at(d, tokens):
        F = 1 if tokens is None else tokens.shape[1]
        logits = torch.randn(B, F, V, generator=gen)
        if draft == "uniform":
            logits = torch.full((B, F, V), 0.3)
        elif draft == "certain":
            logits = logits + 200.0 * torch.nn.functional.one_hot(torch.randint(V, (B, F), generator=gen), V)
        return torch.log_softmax(logits, -1)

    tree = build(shape, logprobs_at)
    check_well_formed(tree)
    if draft != "random":  # some candidates really do tie
        assert (tree.scores[:, :, None] == tree.scores[:, None, :]).sum() > B * shape.draft_tokens


# ---- greedy acceptance ------------------------------------------------------------------------


def brute_force_greedy(tree, target, b):
    tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
    argmax = target[b].argmax(-1).tolist()
    node, path = -1, []
    while True:
        nxt = [j for j in range(len(tokens)) if parents[j] == node and tokens[j] == argmax[node + 1]]
        if not nxt:
            return len(path), path, argmax[node + 1]
        node = nxt[0]
        path.append(node)


@pytest.mark.parametrize("shape", [TreeShape(3, 2, 8), TreeShape(4, 3, 14), TreeShape(2, 1, 2)])
def test_greedy_acceptance_walks_the_target_argmax(shape):
    B, V = 96, 6
    gen = torch.Generator().manual_seed(7)
    tree = random_tree(shape, B, V, gen)
    target = torch.randn(B, shape.verify_tokens, V, generator=gen)
    # Often make the target's argmax at a node one of its children's tokens, so paths run deep.
    children = tree.children()
    for b, slot in itertools.product(range(B), range(shape.verify_tokens)):
        kids = [c for c in children[b, slot].tolist() if c >= 0]
        if kids and torch.rand(1, generator=gen).item() < 0.7:
            pick = kids[torch.randint(len(kids), (1,), generator=gen).item()]
            target[b, slot, tree.tokens[b, pick]] += 20.0
    got = accept_greedy(tree, target)
    for b in range(B):
        count, path, bonus = brute_force_greedy(tree, target, b)
        assert got.count[b].item() == count and got.bonus[b].item() == bonus
        assert got.nodes[b].tolist() == path + [-1] * (shape.k - count)
    if shape.topk > 1:
        assert got.count.max().item() == shape.k and got.count.min().item() == 0


# ---- sampled acceptance: the emitted tokens follow the target --------------------------------


class SecondOrder:
    """A target and a draft over a small vocabulary whose next token depends on the last
    two: logits ``T[prev, cur]`` and ``D[prev, cur]``."""

    def __init__(self, V: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.V = V
        self.target = 1.2 * torch.randn(V, V, V, generator=gen)
        self.draft = self.target + 1.5 * torch.randn(V, V, V, generator=gen)

    def tree(self, shape: TreeShape, prev: torch.Tensor, cur: torch.Tensor):
        def logprobs_at(d, frontier_tokens):
            if frontier_tokens is None:
                return torch.log_softmax(self.draft[prev, cur], -1)[:, None]
            # Depth 2 is the deepest these tests draft: the frontier's parent is ``cur``.
            assert d == 2
            return torch.log_softmax(self.draft[cur[:, None], frontier_tokens], -1)

        return build(shape, logprobs_at)

    def verify_logits(self, tree, prev, cur):
        parent_token = torch.where(tree.parents >= 0, tree.tokens.gather(1, tree.parents.clamp(min=0)), cur[:, None])
        return torch.cat([self.target[prev, cur][:, None], self.target[parent_token, tree.tokens]], dim=1)

    def step(self, shape, prev, cur, temperature, noise):
        tree = self.tree(shape, prev, cur)
        accepted = accept_sampled(tree, self.verify_logits(tree, prev, cur), temperature, noise)
        return tree, accepted, emitted(tree, accepted)

    def first_two(self, shape, B, temperature, seed):
        """The first two tokens emitted after the context ``(r0, r)``, for ``B`` rows."""
        gen = torch.Generator().manual_seed(seed)
        prev, cur = torch.full((B,), 2), torch.full((B,), 4)
        _, accepted, out = self.step(shape, prev, cur, temperature, gen)
        # A row that accepted nothing emits one token; its next step gives the second.
        _, _, after = self.step(shape, cur, out[:, 0], temperature, gen)
        second = torch.where(accepted.count >= 1, out[:, 1], after[:, 0])
        return out[:, 0], second, accepted

    def exact_first_two(self, temperature):
        p1 = torch.softmax(self.target[2, 4].double() / temperature, -1)
        p2 = torch.softmax(self.target[4].double() / temperature, -1)  # [first, second]
        return p1[:, None] * p2


SAMPLED_SHAPES = [TreeShape(2, 2, 4), TreeShape(2, 3, 6), TreeShape(2, 3, 12)]


@pytest.mark.parametrize("shape", SAMPLED_SHAPES)
def test_sampled_tree_emits_the_target_distribution(shape):
    V, B, temperature = 6, 20000, 0.9
    model = SecondOrder(V, seed=11)
    first, second, accepted = model.first_two(shape, B, temperature, seed=12)
    exact = model.exact_first_two(temperature)
    counts = torch.bincount(first * V + second, minlength=V * V).view(V, V)
    assert chi_square_p(counts.sum(1), B * exact.sum(1)) > P_VALUE
    assert chi_square_p(counts, B * exact) > P_VALUE
    # The trial exercised every branch: rejections at both depths, full paths, second siblings.
    assert set(accepted.count.tolist()) == {0, 1, 2}
    tree = model.tree(shape, torch.full((1,), 2), torch.full((1,), 4))
    later_sibling = (accepted.nodes[:, 0] >= 0) & (accepted.nodes[:, 0] != tree.children()[0, 0, 0])
    assert later_sibling.float().mean() > 0.02


@pytest.mark.parametrize("shape", SAMPLED_SHAPES[:2])
def test_the_test_rejects_a_sampler_without_the_residual_update(shape, monkeypatch):
    """Power: trying the next sibling (and drawing the bonus) from the unchanged ``p``
    emits the tried children too often, and the same test says so."""
    V, B, temperature = 6, 20000, 0.9
    model = SecondOrder(V, seed=11)
    monkeypatch.setattr(tree_mod, "_reject", lambda left, token, p_token, rejected, slot: left)
    first, second, _ = model.first_two(shape, B, temperature, seed=12)
    exact = model.exact_first_two(temperature)
    counts = torch.bincount(first * V + second, minlength=V * V).view(V, V)
    assert chi_square_p(counts.sum(1), B * exact.sum(1)) < 1e-12
    assert chi_square_p(counts, B * exact) < 1e-12


def test_the_test_rejects_the_drafts_softmax_as_q():
    """Power, the other way to go wrong: SpecInfer's ``min(1, p / q)`` with the draft's
    softmax as ``q`` is biased on a top-k tree, which is not sampled from ``q``."""
    V, B, temperature = 6, 20000, 0.9
    model = SecondOrder(V, seed=11)
    shape = TreeShape(1, 1, 1)
    gen = torch.Generator().manual_seed(13)
    prev, cur = torch.full((B,), 2), torch.full((B,), 4)
    tree = model.tree(shape, prev, cur)
    logits = model.verify_logits(tree, prev, cur)
    q = torch.softmax(model.draft[prev, cur] / temperature, -1)[:, None]
    count, bonus = accept_chain(logits, tree.tokens, q, temperature, gen)
    first = torch.where(count > 0, tree.tokens[:, 0], bonus)
    exact = torch.softmax(model.target[2, 4].double() / temperature, -1)
    assert chi_square_p(torch.bincount(first, minlength=V), B * exact) < 1e-12
    gen = torch.Generator().manual_seed(13)
    accepted = accept_sampled(tree, logits, temperature, gen)
    assert chi_square_p(torch.bincount(emitted(tree, accepted)[:, 0], minlength=V), B * exact) > P_VALUE


def test_sampled_rows_and_greedy_rows_share_a_batch():
    shape, V, B = TreeShape(3, 2, 8), 6, 64
    gen = torch.Generator().manual_seed(14)
    tree = random_tree(shape, B, V, gen)
    target = torch.randn(B, shape.verify_tokens, V, generator=gen)
    temperature = torch.where(torch.arange(B) % 2 == 0, 0.0, 1.0)
    got = accept_sampled(tree, target, temperature, Noise(torch.device("cpu"), seed=3))
    greedy = accept_greedy(tree, target)
    even = torch.arange(B) % 2 == 0
    for a, b in zip(got, greedy):
        assert torch.equal(a[even], b[even])
    # Paths are paths of the tree, and an accepted child's parent is the previous node.
    for b in range(B):
        nodes = [n for n in got.nodes[b].tolist() if n >= 0]
        assert len(nodes) == got.count[b].item()
        assert [tree.parents[b, n].item() for n in nodes] == ([-1] + nodes)[: len(nodes)]


def test_same_seed_same_tokens():
    """Ranks seeded alike draw alike: the acceptance is a function of the seed."""
    shape, V, B = TreeShape(3, 2, 8), 6, 32
    tree = random_tree(shape, B, V, torch.Generator().manual_seed(15))
    target = torch.randn(B, shape.verify_tokens, V, generator=torch.Generator().manual_seed(16))
    runs = [accept_sampled(tree, target, 1.0, Noise(torch.device("cpu"), seed=5)) for _ in range(2)]
    drawn = accept_sampled(tree, target, 1.0, draw(Noise(torch.device("cpu"), seed=5), B, shape, V, "cpu"))
    for a, b, c in zip(*runs, drawn):
        assert torch.equal(a, b) and torch.equal(a, c)


# ---- commit slots -----------------------------------------------------------------------------


def test_commit_slots_follow_the_accepted_path():
    nodes = torch.tensor([[0, 3, 5], [1, -1, -1], [-1, -1, -1], [2, 4, 7]])
    accepted = Accepted(torch.tensor([3, 1, 0, 3]), nodes, torch.tensor([9, 9, 9, 9]))
    slots, valid = commit_slots(accepted)
    assert slots.tolist() == [[0, 1, 4, 6], [0, 2, 2, 2], [0, 0, 0, 0], [0, 3, 5, 8]]
    assert valid.tolist() == [[True] * 4, [True, True, False, False], [True, False, False, False], [True] * 4]


def test_commit_slots_gather_the_path_from_staging():
    """Gathering the verify step's per-slot values by the commit slots gives the root and
    the accepted nodes in path order: here the slots' positions, base + depth."""
    shape, V, B = TreeShape(4, 3, 12), 5, 64
    gen = torch.Generator().manual_seed(17)
    tree = random_tree(shape, B, V, gen)
    target = torch.randn(B, shape.verify_tokens, V, generator=gen)
    target.scatter_add_(2, torch.cat([tree.tokens[:, :1], tree.tokens], 1)[..., None], torch.full((B, 13, 1), 1.5))
    accepted = accept_sampled(tree, target, 1.0, gen)
    base = torch.randint(100, (B,), generator=gen)
    slots, valid = commit_slots(accepted)
    gathered = tree.positions(base).gather(1, slots)
    expected = base[:, None] + torch.arange(shape.k + 1)
    assert torch.equal(gathered[valid], expected[valid])
    assert torch.equal(valid.sum(1), accepted.count + 1)


# ---- static shapes: the whole step traces as one graph ---------------------------------------


def test_traces_without_graph_breaks():
    shape, V, B = TreeShape(3, 2, 7), 6, 4
    gen = torch.Generator().manual_seed(18)
    logprobs = [torch.log_softmax(torch.randn(B, 1 if d == 0 else shape.topk, V, generator=gen), -1)
                for d in range(shape.k)]
    target = torch.randn(B, shape.verify_tokens, V, generator=gen)
    draws = draw(gen, B, shape, V, "cpu")
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3])

    def step(logprobs, target, draws, temperature, base):
        scores, expansions = torch.zeros(B, 1), []
        for lp in logprobs:
            e = expand(scores, lp, shape.topk)
            expansions.append(e)
            scores = e.scores.gather(1, e.frontier)
        tree = select(shape, expansions)
        accepted = accept_sampled(tree, target, temperature, draws)
        slots, valid = commit_slots(accepted)
        return tree.ancestors, tree.positions(base), emitted(tree, accepted), slots, valid

    args = (logprobs, target, TreeDraws(*draws), temperature, torch.arange(B))
    compiled = torch.compile(step, fullgraph=True, backend="eager", dynamic=False)
    for a, b in zip(compiled(*args), step(*args)):
        assert torch.equal(a, b)
