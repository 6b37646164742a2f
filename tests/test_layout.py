import itertools

import pytest
import sympy
import torch

from dcp_compile import layout as L
from dcp_compile.layout import KVLayout



@pytest.mark.parametrize("size,interleave", list(itertools.product(range(1, 5), (1, 2, 4))))
def test_layout_exhaustive(size, interleave):
    for max_seq_len in range(size * interleave, 65):
        capacity = L.local_capacity(max_seq_len, size, interleave)
        seen = {}
        for p in range(max_seq_len):
            r, s = L.owner(p, size, interleave), L.local_slot(p, size, interleave)
            assert 0 <= r < size and 0 <= s < capacity, (p, r, s)
            assert (r, s) not in seen, f"positions {seen[(r, s)]} and {p} share rank {r} slot {s}"
            seen[(r, s)] = p
            assert L.global_position(s, r, size, interleave) == p
        # every slot below capacity that maps to a real position maps back to its own slot
        for r in range(size):
            for s in range(capacity):
                p = L.global_position(s, r, size, interleave)
                if p < max_seq_len:
                    assert seen[(r, s)] == p
        for length in range(max_seq_len + 1):
            per_rank = [L.local_length(length, r, size, interleave) for r in range(size)]
            assert sum(per_rank) == length
            for r in range(size):
                owned = sorted(L.local_slot(p, size, interleave) for p in range(length) if L.owner(p, size, interleave) == r)
                assert owned == list(range(per_rank[r])), "a rank's first positions fill slots 0..len-1"
            assert max(per_rank) - min(per_rank) <= interleave, "interleaving keeps ranks within one block"


def test_layout_inverse_for_all_positions_symbolically():
    """For every N <= 4, I <= 4, owner r and offset j, the maps invert for every block index a >= 0."""
    a = sympy.Symbol("a", integer=True, nonnegative=True)
    for size, interleave in itertools.product(range(1, 5), (1, 2, 3, 4)):
        for r, j in itertools.product(range(size), range(interleave)):
            p = (a * size + r) * interleave + j
            assert sympy.simplify(L.owner(p, size, interleave) - r) == 0
            slot = L.local_slot(p, size, interleave)
            assert sympy.simplify(slot - (a * interleave + j)) == 0
            assert sympy.simplify(L.global_position(slot, r, size, interleave) - p) == 0


def test_layout_formulas_work_on_tensors():
    p = torch.arange(64)
    for size, interleave in itertools.product(range(1, 5), (1, 2, 4)):
        assert L.owner(p, size, interleave).tolist() == [L.owner(int(x), size, interleave) for x in p]
        assert L.local_slot(p, size, interleave).tolist() == [L.local_slot(int(x), size, interleave) for x in p]
        for r in range(size):
            assert L.local_length(p, r, size, interleave).tolist() == [L.local_length(int(x), r, size, interleave) for x in p]


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
