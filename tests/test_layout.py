import itertools

import pytest
import sympy
import torch

from dcp_compile.layout import KVLayout



@pytest.mark.parametrize("size,interleave", list(itertools.product(range(1, 5), (1, 2, 4))))
def test_layout_exhaustive(size, interleave):
    for max_seq_len in range(size * interleave, 65):
        ranks = [KVLayout(size, r, max_seq_len, interleave) for r in range(size)]
        layout, capacity = ranks[0], ranks[0].local_capacity
        seen = {}
        for p in range(max_seq_len):
            r, s = layout.owner(p), layout.local_slot(p)
            assert 0 <= r < size and 0 <= s < capacity, (p, r, s)
            assert (r, s) not in seen, f"positions {seen[(r, s)]} and {p} share rank {r} slot {s}"
            seen[(r, s)] = p
            assert ranks[r].global_position(s) == p
        # every slot below capacity that maps to a real position maps back to its own slot
        for r in range(size):
            for s in range(capacity):
                p = ranks[r].global_position(s)
                if p < max_seq_len:
                    assert seen[(r, s)] == p
        for length in range(max_seq_len + 1):
            per_rank = [ranks[r].local_length(length) for r in range(size)]
            assert sum(per_rank) == length
            for r in range(size):
                owned = sorted(layout.local_slot(p) for p in range(length) if layout.owner(p) == r)
                assert owned == list(range(per_rank[r])), "a rank's first positions fill slots 0..len-1"
            assert max(per_rank) - min(per_rank) <= interleave, "interleaving keeps ranks within one block"


def test_layout_inverse_for_all_positions_symbolically():
    """For every N <= 4, I <= 4, owner r and offset j, the maps invert for every block index a >= 0."""
    a = sympy.Symbol("a", integer=True, nonnegative=True)
    for size, interleave in itertools.product(range(1, 5), (1, 2, 3, 4)):
        for r, j in itertools.product(range(size), range(interleave)):
            layout = KVLayout(size, r, size * interleave, interleave)
            p = (a * size + r) * interleave + j
            assert sympy.simplify(layout.owner(p) - r) == 0
            slot = layout.local_slot(p)
            assert sympy.simplify(slot - (a * interleave + j)) == 0
            assert sympy.simplify(layout.global_position(slot) - p) == 0


def test_layout_formulas_work_on_tensors():
    p = torch.arange(64)
    for size, interleave in itertools.product(range(1, 5), (1, 2, 4)):
        for r in range(size):
            layout = KVLayout(size, r, 64, interleave)
            assert layout.owner(p).tolist() == [layout.owner(int(x)) for x in p]
            assert layout.local_slot(p).tolist() == [layout.local_slot(int(x)) for x in p]
            assert layout.global_position(p).tolist() == [layout.global_position(int(x)) for x in p]
            assert layout.local_length(p).tolist() == [layout.local_length(int(x)) for x in p]


def test_capacity_without_a_rank_is_the_layouts():
    for size, interleave, max_seq_len in itertools.product(range(1, 5), (1, 2, 4), (16, 17, 63, 64)):
        assert KVLayout.capacity_of(max_seq_len, size, interleave) == KVLayout(size, 0, max_seq_len, interleave).local_capacity


def test_kvlayout_capacity_and_trash_slot():
    layout = KVLayout(size=3, rank=1, max_seq_len=64)
    assert layout.local_capacity == 22 and layout.trash_slot == 22 and layout.local_cache_len == 23


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(size=0, rank=0, max_seq_len=8), "DCP size"),
        (dict(size=2, rank=2, max_seq_len=8), "rank must be"),
        (dict(size=2, rank=0, max_seq_len=8, interleave=0), "interleave"),
        (dict(size=4, rank=0, max_seq_len=3), "smaller than DCP size"),
    ],
)
def test_kvlayout_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVLayout(**kwargs)
