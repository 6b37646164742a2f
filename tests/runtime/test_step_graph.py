"""The whole speculative step as one graph (``runtime.step_graph``) decodes what the step's
calls made one by one decode: chain and tree, greedy and sampled rows (seeded on their own
and not) in one batch, EOS, rows that finish, arrive and are aborted; and the loop reads
the device once per step.  On CPU the step graph runs the step over its static buffers,
uncaptured; the GPU check (``benchmarks/gpu_tree_check.py``) captures it.  The loop launches
each step before it reads the last one's tokens, and the device ends rows where the host does."""

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


def test_every_engine_over_a_decoder_starts_from_its_seed():
    """A captured step holds its generators: a second engine over the same decoder must
    start them over, so that sampled decoding repeats call after call, with or without a
    request's own seed."""
    decoder = make_decoder(SHAPES["chain"], step_graph=True)
    traffic = [(0, PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=0.9)),
               (0, PROMPTS[1], SamplingParams(max_new_tokens=12, temperature=0.9, seed=3))]
    first = run(SpecEngine(decoder), traffic)
    engine = SpecEngine(decoder)
    assert run(engine, traffic) == first
    other = Noise("cpu", 0, rows=3)
    other.seed_row(1, 3)
    engine.state.sampling = True
    with pytest.raises(ValueError, match="captured drawing from another Noise"):
        decoder.device_step.step(engine.state, other)
    decoder.noise.seed_row(1, 3)  # the sampled step with a seeded row: the one this traffic captured
    engine.state.stops = torch.full((3, 2), -1)
    with pytest.raises(ValueError, match=r"the state's stops has shape \(3, 2\), but the step was captured with "
                                         r"\(3, 8\)"), torch.no_grad():
        decoder.device_step.step(engine.state, decoder.noise)


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
    noise.seed_row(1, 7)  # a row seeded again keeps its mask and takes the new seed
    assert noise.seeded.tolist() == [False, True, False]
    reseeded = noise.exponential(like)[1]
    assert torch.equal(reseeded, torch.empty(5).exponential_(1.0, generator=torch.Generator().manual_seed(7)))
    noise.seed_row(1, None)
    noise.seed_row(0, None)  # a row that was never seeded
    assert noise.rows == set() and not noise.seeded.any()
    with pytest.raises(ValueError, match="row 3 is outside the 3 rows"):
        noise.seed_row(3, 1)


@pytest.mark.gpu
def test_seeding_and_freeing_rows_never_waits_for_the_device():
    """The engine seeds a row at each admission and frees it at each finish, while steps
    run: neither may synchronize (a finish used to stall the loop for a step)."""
    noise = Noise("cuda", seed=1, rows=4)
    torch.cuda._sleep(10_000_000)  # a busy stream, as under a running step
    torch.cuda.set_sync_debug_mode("error")
    try:
        noise.seed_row(2, 7)
        noise.seed_row(2, 8)
        noise.seed_row(3, 1)
        noise.seed_row(2, None)
        noise.seed_row(0, None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert noise.seeded.tolist() == [False, False, False, True] and noise.rows == {3}


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

    step = decoder.device_step.step

    def launched(*args):
        reads.append("step")
        return step(*args)

    decoder.device_step.step = launched
    try:
        for name in names:
            setattr(torch.Tensor, name, counted(name))
        decoder.temperature = 0.7
        outputs = dcp.generate_all(decoder, [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 11], 20)
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
    steps = max(len(o.accepted) for o in outputs)
    # Each step is launched before the last one's tokens are read, so one more step runs
    # than the rows took part in: the one launched before the host read that all had ended.
    assert steps > 3 and decoder.device_step.step_graph.replays == steps + 1
    assert reads == ["tolist", "step"] + ["step", "tolist"] * steps, reads


def test_a_step_moves_rows_on_and_ends_them_where_the_host_would():
    """``finish_and_advance``: stop ids count only among the emitted tokens; a row that
    ends or was inactive stays where it was."""
    from dcp_compile.runtime.state import StepState, finish_and_advance, start_rows, stop_rows

    B = 5
    state = StepState(length=torch.full((B,), 10), current=torch.zeros(B, dtype=torch.long), q_logits=None,
                      hidden=None, active=torch.zeros(B, dtype=torch.bool), temperature=torch.zeros(B),
                      sampling=False, remaining=torch.zeros(B, dtype=torch.long),
                      stops=torch.full((B, 2), -1, dtype=torch.long))
    start_rows(state, [0, 1, 2, 3], remaining=[10, 10, 2, 10], stops=[[7], [7, 9], [], [7]])
    new_tokens = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [1, 2, 7, 4], [1, 2, 3, 7], [7, 7, 7, 7]])
    accepted = torch.tensor([3, 3, 3, 2, 3])
    bonus = new_tokens[torch.arange(B), accepted]
    finish_and_advance(state, new_tokens, accepted, bonus)
    # row 0 goes on; 1 met 9; 2 spent its budget of 2; 3's 7 lies past its accepted
    # tokens; 4 was never started
    assert state.active.tolist() == [True, False, False, True, False]
    assert state.length.tolist() == [14, 10, 10, 13, 10]
    assert state.remaining.tolist() == [6, 10, 2, 7, 0]
    assert state.current.tolist() == [4, 0, 0, 3, 0]
    stop_rows(state, [3])
    assert state.active.tolist() == [True, False, False, False, False]
    with pytest.raises(ValueError, match="up to 2 stop ids"):
        start_rows(state, [4], remaining=[1], stops=[[1, 2, 3]])


def test_the_engine_refuses_a_device_that_ends_rows_the_host_keeps():
    """The host and the device decide each row's end from the same tokens; the engine
    checks every step, so a device state that drifts fails loudly, not silently."""
    decoder = make_decoder(SHAPES["chain"], step_graph=True)
    engine = SpecEngine(decoder)
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=40))
    engine.step()  # the prefill and the first step
    engine.state.remaining.fill_(1)  # the device now ends the row after the next step
    with pytest.raises(RuntimeError, match="the device ended it"):
        for _ in range(3):
            engine.step()


def test_a_captured_step_takes_the_attention_kernels_opaque_unless_asked():
    """Captured, an op's dispatch is paid once, so the compile-cheaper opaque kernels are
    the default there; uncaptured calls keep them inlined."""
    options = dcp.SpecDecoder._check_options
    cuda, cpu = dcp.DCPGroup(1, 0, torch.device("cuda"), None), dcp.init_group("cpu")
    assert options(cuda, 0.0, None, True, None, False) == (True, "opaque")
    assert options(cuda, 0.0, "inline", True, None, False) == (True, "inline")
    assert options(cpu, 0.0, None, False, None, False) == (False, "inline")
    with pytest.raises(ValueError, match="kernels must be one of"):
        options(cpu, 0.0, "fused", False, None, False)
