"""Verify graphs defer their KV writes to staging slots; KVCommit moves the accepted ones."""

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.models import LlamaConfig
from dcp_compile.runtime.commit import KVCommit
from dcp_compile.runtime.launch import spawn_ranks
from tests.support import FP32_TOLERANCE, make_model
from tests.runtime.workers import verify_commit_worker, verify_overflow_worker


@pytest.mark.parametrize("size", [1, 2, 3])
def test_verify_then_commit_matches_unsharded(size):
    k, rounds = 3, 5
    for r in spawn_ranks(verify_commit_worker, size, k, rounds, 7):
        assert len(r["outs"]) == rounds + 2
        for out, ref in zip(r["outs"], r["refs"]):
            torch.testing.assert_close(out, ref, **FP32_TOLERANCE)
        assert r["commit_needed"] == (size > 1)
        if size > 1:
            assert all(r["untouched"]), "a sharded verify graph must not write committed or trash slots"
            assert "staging_slots" in r["verify_graph"] and "local_slots" not in r["verify_graph"]


def test_verify_graph_needs_enough_staging_slots():
    for message in spawn_ranks(verify_overflow_worker, 2):
        assert message is not None
        assert "brings 3 new tokens per sequence but prepare reserved verify_tokens=2" in message


def test_verify_is_a_target_option():
    group = dcp.DCPGroup(size=2, rank=0, device=torch.device("cpu"), process_group=None)
    backend = dcp.backend(group, verify=True, lowering="aot_eager")
    assert backend.verify
    with pytest.raises(ValueError, match="verify=True applies to target graphs"):
        dcp.backend(group, "draft", verify=True)


def test_commit_on_a_group_of_one_does_nothing():
    cfg = LlamaConfig()
    model = make_model(cfg)
    dcp.prepare(model, dcp.init_group("cpu"), "target", max_batch=3, max_seq_len=64, verify_tokens=4)
    assert model.layers[0].attention.k_cache.shape[2] == 64, "the off arm keeps the unmodified cache"
    commit = KVCommit(model)
    assert not commit.needed
    before = model.layers[0].attention.k_cache.clone()
    commit(torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    assert torch.equal(before, model.layers[0].attention.k_cache)


@pytest.mark.parametrize("rank,interleave", [(0, 1), (1, 1), (0, 2), (1, 2)])
def test_a_tree_path_lands_in_its_owners_slots_and_nothing_else_changes(rank, interleave):
    """One rank of two: the accepted path's nodes sit in non-contiguous staging slots
    (tree order); each lands in the slot of position ``start + t`` if this rank owns it,
    every other slot but the trash keeps its contents."""
    from torch import nn

    from dcp_compile.layout import KVLayout
    from dcp_compile.records import CacheRecord, register

    B, H, D, S, staging = 3, 2, 4, 32, 9
    layout = KVLayout(2, rank, S, interleave)
    holder = nn.Module()
    holder.register_buffer("k_cache", torch.randn(B, H, layout.local_cache_len + staging, D))
    register(holder.k_cache, CacheRecord("k_cache", "target", 2, layout, (B, H, S, D), staging))
    cache = holder.k_cache
    start = torch.tensor([0, 5, 13])
    accepted = torch.tensor([3, 1, 4])
    path = torch.tensor([[0, 2, 5, 5, 5], [0, 0, 0, 0, 0], [0, 1, 4, 8, 8]])  # commit_slots: last repeated
    before = cache.clone()
    KVCommit(holder)(start, accepted, path)
    expected = before.clone()
    for b in range(B):
        for t in range(int(accepted[b])):
            position = int(start[b]) + t
            if (position // interleave) % 2 == rank:  # the owner's block, and its slot there
                slot = (position // (interleave * 2)) * interleave + position % interleave
                expected[b, :, slot] = before[b, :, layout.local_cache_len + int(path[b, t])]
    trash = layout.trash_slot
    assert torch.equal(torch.cat([cache[:, :, :trash], cache[:, :, trash + 1:]], 2),
                       torch.cat([expected[:, :, :trash], expected[:, :, trash + 1:]], 2))


def test_a_tree_path_of_another_shape_is_refused():
    from torch import nn

    from dcp_compile.layout import KVLayout
    from dcp_compile.records import CacheRecord, register

    layout = KVLayout(2, 0, 16, 1)
    holder = nn.Module()
    holder.register_buffer("k_cache", torch.zeros(2, 1, layout.local_cache_len + 3, 4))
    register(holder.k_cache, CacheRecord("k_cache", "target", 2, layout, (2, 1, 16, 4), 3))
    with pytest.raises(ValueError, match=r"path must be int64 \[batch=2, at most verify_tokens=3\]"):
        KVCommit(holder)(torch.tensor([0, 0]), torch.tensor([1, 1]), torch.zeros(2, 5, dtype=torch.long))
