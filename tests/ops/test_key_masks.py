"""The key-padding masks of the cascade: over every rank of a group, the keys each new
token may see are exactly the unsharded ``causal AND mask[b, s]``."""

import pytest
import torch

from dcp_compile.layout import KVLayout
from dcp_compile.ops.cascade import key_visible, prefix_allowed, prefix_lengths, window_allowed


def test_key_visible_reads_nonzero_and_is_false_outside_the_mask():
    mask = torch.tensor([[0, 1, 2, 0], [1, 1, 0, 1]])
    positions = torch.tensor([[0, 1, 2, 3, 4, -1], [0, 2, 3, 7, 1, 1]])
    expected = torch.tensor([[False, True, True, False, False, False], [True, False, True, False, True, True]])
    assert torch.equal(key_visible(mask, positions), expected)


@pytest.mark.parametrize("size,interleave", [(1, 1), (2, 1), (3, 2)])
def test_ranks_together_see_the_unsharded_keys(size, interleave):
    S, B = 24, 3
    gen = torch.Generator().manual_seed(size)
    keep = torch.rand(B, S, generator=gen) > 0.3
    starts = torch.tensor([0, 5, 11])
    T = 4
    positions = starts[:, None] + torch.arange(T)  # [B, T]: each row's new tokens
    global_pos = torch.arange(S)
    expected = (global_pos[None, None, :] <= positions[:, :, None]) & keep[:, None, :]  # [B, T, S]
    seen = torch.zeros(B, T, S, dtype=torch.int64)
    for rank in range(size):
        layout = KVLayout(size, rank, S, interleave)
        kv_len = prefix_lengths(positions, size=size, rank=rank, interleave=interleave, max_seq_len=S)
        slots = layout.local_cache_len + 2  # trash and staging slots are never visible
        allowed = prefix_allowed(positions, kv_len, keep, slots=slots, size=size, rank=rank, interleave=interleave,
                                 max_seq_len=S).expand(B, T, slots)
        held = layout.global_position(torch.arange(slots))
        for j in range(slots):
            if allowed[..., j].any():
                seen[..., held[j]] += allowed[..., j].long()
    window = window_allowed(positions, keep)  # [B, T, T], keys at positions[b, u]
    for b in range(B):
        for u in range(T):
            seen[b, :, positions[b, u]] += window[b, :, u].long()
    assert seen.max() <= 1, "a key counted twice"
    assert torch.equal(seen.bool(), expected)
