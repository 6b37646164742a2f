"""CUDA-graph replay of the speculative step (one graph per step, or its calls captured one
by one): no recompile, no recapture, same tokens."""

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.models.pretrained import load_pair
from dcp_compile.runtime.spec import SpecDecoder

PROMPTS = [list(b"def f(x):\n"), list(b"import os\n\n\ndef walk(root):\n")]


def decoder(device, cuda_graphs, step_graph=None):
    target, draft = load_pair("tiny-code", max_batch=2, max_seq_len=96, device=device,
                              dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return SpecDecoder(target, draft, dcp.DCPGroup(1, 0, device, None), k=4, max_batch=2, max_seq_len=96,
                       cuda_graphs=cuda_graphs, step_graph=step_graph, lowering="inductor")


def test_cuda_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        decoder(torch.device("cpu"), True)


@pytest.mark.gpu
@pytest.mark.parametrize("step_graph", [True, False], ids=["one-graph", "calls"])
def test_steady_state_neither_recompiles_nor_recaptures(step_graph):
    from torch._dynamo.utils import counters

    device = torch.device("cuda", 0)
    graphed = decoder(device, True, step_graph)
    first = dcp.generate_all(graphed, PROMPTS, 40)
    compiles, captures = counters["stats"]["unique_graphs"], [r.captures for r in graphed.graph_runners]
    if step_graph:  # the step (greedy: one graph), then the calls' runners, never used
        assert captures == [1, 0, 0], captures
    else:
        assert captures == [1, 2], "verify, and the draft's extend and step shapes (one GPU: no commit to capture)"
    second = dcp.generate_all(graphed, PROMPTS, 40)
    assert counters["stats"]["unique_graphs"] == compiles, "the second generation compiled a graph"
    assert [r.captures for r in graphed.graph_runners] == captures, "the second generation recaptured"
    assert all(r.replays > 0 for r, n in zip(graphed.graph_runners, captures) if n)
    assert [o.tokens for o in second] == [o.tokens for o in first]
    plain = dcp.generate_all(decoder(device, False), PROMPTS, 40)
    assert [o.tokens for o in plain] == [o.tokens for o in first]
    assert [o.accepted for o in plain] == [o.accepted for o in first]


@pytest.mark.gpu
def test_the_engine_sees_the_device_wait_for_a_slow_host():
    """``SpecEngine.stats``' device wait is the device's idle time between two steps: a
    host that sleeps 50 ms before each launch shows as about 50 ms a gap; a host that
    launches at once keeps the device far busier."""
    import time

    from dcp_compile.runtime.engine import SamplingParams, SpecEngine

    graphed = decoder(torch.device("cuda", 0), True)
    dcp.generate_all(graphed, PROMPTS, 40)  # compiles and captures

    def waits(pause: float) -> dict:
        engine = SpecEngine(graphed)
        for prompt in PROMPTS:
            engine.add_request(prompt, SamplingParams(max_new_tokens=60))
        while engine.has_work():
            time.sleep(pause)
            engine.step()
        return engine.stats

    slow, fast = waits(0.05), waits(0.0)
    assert slow["device_waits"] >= 5 and fast["device_waits"] >= 5
    assert 0.045 < slow["device_wait_seconds"] / slow["device_waits"] < 0.2
    assert fast["device_wait_seconds"] / fast["device_waits"] < 0.01
    assert 0 < slow["device_step_seconds"] < slow["device_wait_seconds"]
    # every 50 ms gap is a pause past LONG_WAIT_SECONDS
    assert slow["device_long_waits"] == slow["device_waits"]
    assert slow["device_long_wait_seconds"] == slow["device_wait_seconds"]
    assert fast["device_long_wait_seconds"] <= fast["device_wait_seconds"]
