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


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """A fresh GGUF conversion cache (``DCP_COMPILE_CACHE``) for the session; spawned ranks
    inherit it."""
    root = tmp_path_factory.mktemp("dcp-compile-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DCP_COMPILE_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def smollm2(cache):
    """``--model smollm2`` resolved, converting the installed GGUF into the cache once for
    every module that reads it."""
    import time

    from dcp_compile.commands import loading

    start = time.perf_counter()
    spec = loading.resolve("smollm2")
    print(f"\nresolve('smollm2'), converting: {time.perf_counter() - start:.1f}s")
    return spec
