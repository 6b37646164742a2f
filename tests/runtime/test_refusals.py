"""No silent wrong answers: a prepared (sharded) target runs only through graphs that
dcp.backend compiled; every other route raises on every rank before writing."""

import torch

from dcp_compile.runtime.launch import spawn_ranks
from tests.support import FP32_TOLERANCE
from tests.runtime.workers import refusal_worker

NOT_DCP = "did not go through a graph compiled by dcp.backend"


def test_every_route_around_the_backend_is_refused_and_writes_nothing():
    for r in spawn_ranks(refusal_worker, 2, timeout=600):
        errors = r["errors"]
        for route in ("eager", "aot_eager", "inductor"):
            assert errors[route] is not None and NOT_DCP in errors[route], (route, errors[route])
        assert "batch of 4 rows, but the model was prepared for max_batch=3" in errors["too many rows"]
        assert all(r["untouched"].values()), r["untouched"]
        torch.testing.assert_close(r["logits"], r["reference_logits"], **FP32_TOLERANCE)
        assert "replaced its KV caches" in r["to_error"] and "then call dcp.prepare" in r["to_error"]
