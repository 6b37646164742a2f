"""A tree verify under DCP: every node attends to the committed prefix, its ancestors and
itself, whatever the group's size and interleave, and the commit of a non-contiguous
path leaves the caches as if that path had been decoded token by token."""

import pytest
import torch

from dcp_compile.runtime.launch import spawn_ranks
from tests.runtime.workers import tree_verify_commit_worker
from tests.support import FP32_TOLERANCE


@pytest.mark.parametrize("size", [1, 2, 3])
def test_tree_verify_then_path_commit_matches_the_paths_decoded_alone(size):
    rounds = 4
    interleaves = (1,) if size == 1 else (1, 2)
    for r in (run for rank in spawn_ranks(tree_verify_commit_worker, size, interleaves, rounds, 5) for run in rank):
        assert len(r["outs"]) == rounds + 2
        for out, ref in zip(r["outs"], r["refs"]):
            torch.testing.assert_close(out, ref, **FP32_TOLERANCE)
        assert r["commit_needed"], "a tree target stages its verify on a group of one too"
        assert all(r["untouched"]), "a tree verify must not write committed or trash slots"
        assert "staging_slots" in r["verify_graph"] and "ancestors" in r["verify_graph"]
        # The test means something only if some committed path skips staging slots.
        assert any(path != list(range(len(path))) for path in r["paths"]), r["paths"]
