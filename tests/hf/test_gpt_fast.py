"""A gpt-fast model file, unchanged, under DCP against itself unsharded and eager."""

import pytest
import torch

from dcp_compile.runtime.launch import spawn_ranks
from tests.support import FP32_TOLERANCE
from tests.hf.workers import gpt_fast_worker

STEPS = 8


@pytest.mark.parametrize("size", [2, 3])
def test_gpt_fast_parity(size):
    results = spawn_ranks(gpt_fast_worker, size, STEPS, timeout=600)
    for rank, r in enumerate(results):
        assert torch.equal(r["tokens"], r["reference_tokens"]), f"rank {rank}: tokens differ"
        torch.testing.assert_close(r["logits"], r["reference_logits"], **FP32_TOLERANCE)
        assert torch.equal(r["logits"], results[0]["logits"])
    r = results[0]
    assert r["collectives"] == [4, 4], "prefill and decode graphs: all-gather + wait per layer"
    assert r["mask_buffers"] == ("causal_mask",) and r["causal_mask"] == (64, -(-64 // size) + 1)
    assert "causal-mask table causal_mask" in r["banded_error"] and "not lower triangular" in r["banded_error"]
    assert "batch of 3 rows, but the model was prepared for max_batch=2" in r["batch_error"]
    assert len(r["generate_py_errors"]) == (2 if size == 2 else 0)
    for name, error in r["generate_py_errors"].items():
        assert error is not None and "did not go through a graph compiled by dcp.backend" in error, (name, error)
