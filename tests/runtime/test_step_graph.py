"""The whole speculative step as one graph (``runtime.step_graph``) decodes what the step's
calls made one by one decode: chain and tree, greedy and sampled rows (seeded on their own
and not) in one batch, EOS, rows that finish, arrive and are aborted; and the loop reads
the device once per step.  On CPU the step graph runs the step over its static buffers,
uncaptured; the GPU check (``benchmarks/gpu_tree_check.py``) captures it."""

import sys

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.runtime.engine import SamplingParams, SpecEngine
from dcp_compile.runtime.sampling import Noise
from tests.runtime.test_engine import PROMPTS, run
from tests.support import agreeing_pair

SHAPES = {"chain": dict(k=3), "tree": dict(k=3, topk=2, draft_tokens=6)}


def make_decoder(shape: dict, step_graph: bool):
    torch._dynamo.reset()
    target, draft = agreeing_pair("eagle3", noise=3.0, max_batch=3)
    return dcp.SpecDecoder(target, draft, dcp.init_group("cpu"), max_batch=3, max_seq_len=96, seed=4,
                           lowering="aot_eager", step_graph=step_graph, **shape)


def traffic(eos: int | None):
    """Six requests through three rows: greedy, sampled, sampled with a seed of their
    own, one ending at ``eos``; two arrive mid-run and one is aborted; the first outlasts
    the sampled ones, so the last steps are greedy alone."""
    params = [
        SamplingParams(max_new_tokens=70),
        SamplingParams(max_new_tokens=20, temperature=0.8),
        SamplingParams(max_new_tokens=9, temperature=0.8, seed=7),
        SamplingParams(max_new_tokens=30, eos_id=eos),
        SamplingParams(max_new_tokens=14, temperature=1.0, seed=8),
        SamplingParams(max_new_tokens=16, temperature=0.6),
    ]
    arrivals = list(zip([0, 0, 0, 2, 5, 6], PROMPTS, params))
    return arrivals, [(8, 5)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_step_graph_decodes_what_the_calls_decode(shape):
    calls = make_decoder(SHAPES[shape], step_graph=False)
    probe = run(SpecEngine(calls), [(0, PROMPTS[3], SamplingParams(max_new_tokens=30))])["tokens"][0]
    eos = probe[6]  # a token the greedy request meets part-way
    one_by_one = run(SpecEngine(calls), *traffic(eos))
    graphed = make_decoder(SHAPES[shape], step_graph=True)
    whole = run(SpecEngine(graphed), *traffic(eos))
    assert whole == one_by_one
    step_graph = graphed.device_step.step_graph
    assert calls.device_step.step_graph is None and step_graph.replays == graphed.device_step.verify_steps > 10
    # greedy steps, sampled steps, and sampled steps with a seeded row each have their graph
    assert set(step_graph.steps) == {(False, False), (True, False), (True, True)}
    # every kind of ending was exercised
    assert set(one_by_one["ends"]) == {"length", "eos", "aborted"}, one_by_one["ends"]


def test_a_seeded_row_draws_from_its_own_generator_alone():
    """A row's numbers depend on its seed, not on the other rows' seeds or the shared stream."""
    like = torch.empty(3, 5)
    noise = Noise("cpu", seed=1, rows=3)
    noise.seed_row(1, 42)
    first = noise.exponential(like)
    other = Noise("cpu", seed=2, rows=3)
    other.seed_row(1, 42)
    other.seed_row(2, 5)
    second = other.exponential(like)
    alone = torch.empty(5).exponential_(1.0, generator=torch.Generator().manual_seed(42))
    assert torch.equal(first[1], alone) and torch.equal(second[1], alone)
    assert not torch.equal(first[0], second[0])  # unseeded rows follow the shared stream
    noise.seed_row(1, None)
    assert noise.rows == set() and not noise.seeded.any()
    with pytest.raises(ValueError, match="row 3 is outside the 3 rows"):
        noise.seed_row(3, 1)


def test_the_step_graph_and_the_rank_check_are_refused_together():
    target, draft = agreeing_pair("eagle3", noise=3.0, max_batch=3)
    with pytest.raises(ValueError, match="step_graph=True and check_ranks=True"):
        dcp.SpecDecoder(target, draft, dcp.init_group("cpu"), k=3, max_batch=3, max_seq_len=96, step_graph=True,
                        check_ranks=True)


def test_the_step_graph_loop_reads_the_device_once_per_step():
    """Host reads made by the loop itself (dcp_compile/runtime): one after the prefill and
    one per verify step."""
    decoder = make_decoder(SHAPES["tree"], step_graph=True)
    reads = []
    names = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def counted(name):
        original = saved[name]

        def read(self, *args, **kwargs):
            if "dcp_compile/runtime" in sys._getframe(1).f_code.co_filename:
                reads.append(name)
            return original(self, *args, **kwargs)

        return read

    try:
        for name in names:
            setattr(torch.Tensor, name, counted(name))
        decoder.temperature = 0.7
        outputs = dcp.generate_all(decoder, [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 11], 20)
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
    steps = max(len(o.accepted) for o in outputs)
    assert steps > 3 and decoder.device_step.step_graph.replays == steps
    assert reads == ["tolist"] * (steps + 1), reads
