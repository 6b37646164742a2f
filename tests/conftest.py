import os

import pytest
import torch

for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(var, None)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch: no cache entries or recompile counts leak across tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
