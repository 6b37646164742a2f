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
