"""Tree drafts end to end: the DCP arm gives the off arm's tokens and accept counts bitwise
(fp32, greedy and sampled rows in one batch, N = 2 and 3), greedy trees give the target's
own greedy continuation, and a chain run through the tree's graphs is the chain."""

import pytest

from dcp_compile.runtime.launch import spawn_ranks
from dcp_compile.runtime.tree import TreeShape
from tests.runtime.workers import TREE_TEMPERATURES, tree_spec_worker

K, TOPK, DRAFT_TOKENS, NEW_TOKENS = 4, 3, 10, 24
TREE = dict(k=K, topk=TOPK, draft_tokens=DRAFT_TOKENS)
OFF_ONLY = (dict(k=0), dict(k=K), dict(k=K, tree=True))
GREEDY_ROWS = [i for i, t in enumerate(TREE_TEMPERATURES) if t == 0]
SAMPLED_ROWS = [i for i, t in enumerate(TREE_TEMPERATURES) if t > 0]


def run(size, runs):
    ranks = spawn_ranks(tree_spec_worker, size, runs, NEW_TOKENS, timeout=900)
    for other in ranks[1:]:
        assert [(r["tokens"], r["accepted"]) for r in other] == [(r["tokens"], r["accepted"]) for r in ranks[0]]
    return ranks[0]


@pytest.fixture(scope="module")
def off_arm():
    tree, plain, chain, chain_as_tree = run(1, (TREE,) + OFF_ONLY)
    return dict(tree=tree, plain=plain, chain=chain, chain_as_tree=chain_as_tree)


def test_a_greedy_tree_gives_the_targets_own_greedy_tokens(off_arm):
    tree, plain = off_arm["tree"], off_arm["plain"]
    assert tree["tree"] == TreeShape(K, TOPK, DRAFT_TOKENS)
    assert [tree["tokens"][i] for i in GREEDY_ROWS] == [plain["tokens"][i] for i in GREEDY_ROWS]
    seen = {a for i in GREEDY_ROWS for a in tree["accepted"][i]}
    assert {0, K} <= seen, f"the batch must reject a whole tree and accept a full path, saw {sorted(seen)}"


def test_a_tree_accepts_more_than_the_chain_of_its_depth(off_arm):
    def mean(result):
        counts = [a for i in GREEDY_ROWS for a in result["accepted"][i]]
        return sum(counts) / len(counts)

    assert mean(off_arm["tree"]) > mean(off_arm["chain"])


def test_a_chain_through_the_tree_graphs_is_the_chain(off_arm):
    """Greedy rows only: a sampled chain drafts samples of the draft and accepts by
    ``p / q``, a tree drafts the draft's top tokens and accepts by ``p`` (both exact, but
    other draws)."""
    chain, as_tree = off_arm["chain"], off_arm["chain_as_tree"]
    assert chain["tree"] is None and as_tree["tree"] == TreeShape(K, 1, K)
    for i in GREEDY_ROWS:
        assert as_tree["tokens"][i] == chain["tokens"][i] and as_tree["accepted"][i] == chain["accepted"][i]


@pytest.mark.parametrize("size", [2, 3])
def test_dcp_trees_give_the_off_arms_tokens_and_accept_counts(size, off_arm):
    """The DCP arm runs each step as one graph (``step_graph``; on CPU over its static
    buffers), the off arm makes the step's calls one by one: ranks agree, and both agree.
    At N = 3 the target's caches are paged (pages of 2 slots a rank, a pool of 192 tokens)."""
    paging = dict(page_size=2, kv_tokens=192) if size == 3 else {}
    (dcp_arm,) = run(size, (TREE | dict(step_graph=True, check_ranks=False) | paging,))
    off = off_arm["tree"]
    assert dcp_arm["tokens"] == off["tokens"] and dcp_arm["accepted"] == off["accepted"]
    assert all(n == 4 for n in dcp_arm["paged_graphs"]) if paging else not any(dcp_arm["paged_graphs"])
    # Sampling went untested unless some sampled row left the target's greedy path.
    plain = off_arm["plain"]["tokens"]
    assert any(dcp_arm["tokens"][i] != plain[i] for i in SAMPLED_ROWS)
    assert dcp_arm["draft_collectives"] and not any(dcp_arm["draft_collectives"]), "tree drafts stay whole"
    # Whole, plus the tree slots its depths keep their nodes in: the frontier of every depth but the last.
    assert dcp_arm["draft_cache"] == (4, 2, 96 + (K - 1) * TOPK, 16), "the draft cache stays whole"
