"""The paged pool's bookkeeping: pages, reference counts, the prefix index and eviction."""

import pytest

from dcp_compile.runtime.pool import PagePool, PoolShape, prefix_keys


def test_a_logical_page_spans_p_times_d_tokens():
    shape = PoolShape(page_size=16, dcp_size=4, kv_tokens=1024)
    assert (shape.page_tokens, shape.pages) == (64, 16)
    assert [shape.pages_for(n) for n in (1, 64, 65, 1024)] == [1, 1, 2, 16]


@pytest.mark.parametrize("fields, message", [
    (dict(page_size=0, dcp_size=2, kv_tokens=64), "page_size must be a positive int, got 0"),
    (dict(page_size=16, dcp_size=2, kv_tokens=20), "kv_tokens=20 is less than one page of 32 tokens"),
])
def test_a_pool_that_cannot_hold_a_page_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        PoolShape(**fields)


def test_pages_are_handed_out_once_and_come_back():
    pool = PagePool(PoolShape(page_size=4, dcp_size=2, kv_tokens=40))  # 5 pages
    first, second = pool.allocate(3), pool.allocate(2)
    assert sorted(first + second) == list(range(5)) and pool.available == 0
    assert pool.allocate(1) is None, "no page is handed out twice"
    pool.release(first)
    assert pool.available == 3 and pool.used == 2
    with pytest.raises(ValueError, match="released more often than it was taken"):
        pool.release(first[:1])


def test_keys_name_the_whole_prefix_and_the_token_after_it():
    a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    c = prefix_keys([0, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    d = prefix_keys([1, 2, 3, 4, 0, 6, 7, 8, 9], 4)
    assert len(a) == 2 and len(b) == 1 and a[0] == b[0], "a page no token follows has no key"
    assert c[1] != a[1], "the second page's key depends on the first page's tokens"
    assert d[0] != a[0], "a page's key depends on the token after it (the draft's keys read it)"


def test_a_shared_prefix_reuses_its_pages_and_never_the_last_tokens_page():
    pool = PagePool(PoolShape(page_size=2, dcp_size=2, kv_tokens=40))  # pages of 4 tokens
    prompt = list(range(10, 21))  # 11 tokens: 2 whole pages and 3 tokens
    pages = pool.allocate(3)
    assert pool.publish(prompt, pages) == [0, 1]
    assert pool.publish(prompt, pages) == [], "a page is indexed once"
    same = pool.match(prompt)
    assert same == pages[:2] and [pool.references(p) for p in pages[:2]] == [2, 2]
    assert pool.match(prompt[:8]) == pages[:1], "a prompt of exactly 2 pages computes its last page again"
    assert pool.match([99] + prompt[1:]) == [], "a different first token shares nothing"
    pool.release(same + pool.match(prompt[:8]))
    assert pool.match(prompt, granularity=2) == pages[:2] and pool.match(prompt[:8], granularity=2) == [], \
        "a hit is cut to a multiple of the granularity (the prefill's chunks)"


def test_cached_pages_no_one_holds_are_evicted_least_recently_used_first():
    pool = PagePool(PoolShape(page_size=2, dcp_size=1, kv_tokens=8))  # 4 pages of 2 tokens
    a, b = [1, 2, 3], [7, 8, 9]
    pages_a, pages_b = pool.allocate(2), pool.allocate(2)
    pool.publish(a, pages_a), pool.publish(b, pages_b)
    pool.release(pages_a), pool.release(pages_b)
    assert pool.available == 4 and pool.used == 0, "cached pages count as available"
    assert pool.match(b) == pages_b[:1]
    pool.release(pages_b[:1])  # b's page is now the most recently used
    taken = pool.allocate(3)
    assert pages_a[0] in taken and pool.match(a) == [], "a's cached page went first"
    assert pool.match(b) == pages_b[:1], "b's, used later, is still cached"
    assert pool.allocate(1) is None, "a page someone holds is never evicted"
