"""Rows' pages and the block table: admission by tokens, growth, prefix reuse, preemption
order and refusal, each checked against the table the graphs would read."""

import pytest
import torch

from dcp_compile.runtime.block_tables import BlockTables
from dcp_compile.runtime.pool import PagePool, PoolShape


def tables(pages=6, page_size=2, dcp_size=2, max_batch=3, max_seq_len=16):
    """A pool of ``pages`` logical pages of ``page_size * dcp_size`` tokens."""
    pool = PagePool(PoolShape(page_size=page_size, dcp_size=dcp_size, kv_tokens=pages * page_size * dcp_size))
    return BlockTables(pool, max_batch, max_seq_len)


def test_a_row_holds_the_pages_of_its_tokens_and_the_rest_name_the_null_page():
    bt = tables()  # pages of 4 tokens, 4 pages a row
    assert bt.null_page == 6 and bt.table.shape == (3, 4) and (bt.table == 6).all()
    admitted = bt.admit(1, prompt=[5, 6, 7, 8, 9], tokens=7)  # 5 prompt tokens and a step of 2
    assert admitted.cached_tokens == 0 and admitted.pages == 2
    assert bt.table[1, :2].tolist() == bt.pages_of(1) and bt.table[1, 2:].tolist() == [6, 6]
    assert (bt.table[[0, 2]] == 6).all(), "other rows are untouched"
    assert bt.grow(1, 9) and len(bt.pages_of(1)) == 3 and bt.table[1, 2] == bt.pages_of(1)[2]
    assert bt.grow(1, 12) and len(bt.pages_of(1)) == 3, "12 tokens still fit 3 pages"
    bt.release(1)
    assert (bt.table[1] == 6).all() and bt.pool.available == 6


def test_the_null_page_is_never_handed_out():
    bt = tables(pages=3, max_seq_len=12)
    for row in range(3):
        assert bt.admit(row, prompt=[row], tokens=4) is not None
    assert sorted(bt.table[:, 0].tolist()) == [0, 1, 2] and bt.null_page not in bt.table[:, 0].tolist()


def test_a_request_is_admitted_only_when_its_pages_are_free_and_then_takes_nothing():
    bt = tables(pages=4)
    assert bt.admit(0, prompt=list(range(10)), tokens=12).pages == 3
    assert bt.admit(1, prompt=[1, 2, 3, 4, 5], tokens=6) is None, "2 pages needed, 1 free"
    assert bt.pool.available == 1 and (bt.table[1] == bt.null_page).all()
    assert bt.admit(1, prompt=[1, 2], tokens=3).pages == 1


def test_growth_that_the_pool_cannot_give_fails_without_taking_pages():
    bt = tables(pages=3)
    bt.admit(0, prompt=[1, 2, 3], tokens=4)
    bt.admit(1, prompt=[4, 5, 6, 7, 8], tokens=8)
    assert not bt.grow(0, 5), "a second page for row 0: none is free"
    assert bt.pool.available == 0 and len(bt.pages_of(0)) == 1
    assert bt.newest([0, 1]) == 1, "row 1 was admitted last: it is preempted"
    bt.release(1)
    assert bt.grow(0, 5) and len(bt.pages_of(0)) == 2


def test_a_shared_prefix_is_reused_and_counted_as_cached_tokens():
    bt = tables(pages=8, max_seq_len=32)
    system = list(range(100, 108))  # two whole pages of 4 tokens
    first = system + [1, 2, 3]
    assert bt.admit(0, first, tokens=len(first) + 2).cached_tokens == 0
    assert bt.publish(0, first) == [0, 1]
    second = system + [1, 9]
    admitted = bt.admit(1, second, tokens=len(second) + 2)
    assert admitted.cached_tokens == 8 and bt.pages_of(1)[:2] == bt.pages_of(0)[:2]
    assert bt.pages_of(1)[2] not in bt.pages_of(0), "the page past the shared prefix is its own"
    bt.release(0)
    assert all(bt.pool.references(p) == 1 for p in bt.pages_of(1)[:2]), "row 1 still holds the shared pages"


def test_requests_that_could_never_fit_are_refused_with_their_need_and_the_pool():
    bt = tables(pages=6, max_seq_len=16)
    assert bt.refusal(16) is None
    assert "needs 25 tokens of KV (7 pages of 4), more than the pool's 24 (6 pages)" in bt.refusal(25)
    small_rows = tables(pages=6, max_seq_len=8)
    assert "more than a row's 8 (max_seq_len)" in small_rows.refusal(12)


def test_misuse_is_refused():
    bt = tables()
    bt.admit(0, [1], tokens=2)
    with pytest.raises(ValueError, match="still holds 1 pages: release it first"):
        bt.admit(0, [1], tokens=2)
    with pytest.raises(ValueError, match="more than its 16"):
        bt.grow(0, 17)
    with pytest.raises(ValueError, match="holds a request"):
        bt.newest([1, 2])
    assert bt.table.dtype == torch.int32
