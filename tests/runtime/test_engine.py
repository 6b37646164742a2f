"""SpecEngine: requests that join and leave a running batch."""

import pytest

import dcp_compile as dcp
from dcp_compile.runtime.engine import SamplingParams, SpecEngine, cut_at_stop
from dcp_compile.runtime.launch import spawn_ranks
from tests.runtime.workers import engine_leader_worker
from tests.support import agreeing_pair

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 11, [3, 1, 4, 1, 5], [2, 7], [6] * 20]


def make_decoder(max_batch=3, temperature=0.0, seed=0):
    target, draft = agreeing_pair("eagle3", noise=3.0, max_batch=max_batch)
    return dcp.SpecDecoder(target, draft, dcp.init_group("cpu"), k=3, max_batch=max_batch, max_seq_len=96,
                           temperature=temperature, seed=seed, lowering="aot_eager")


def run(engine, arrivals=(), aborts=(), max_steps=200):
    """Step until idle; ``arrivals``: (step, prompt, params), ``aborts``: (step, request id).
    Returns tokens, accept counts and ends per request id, and the row each request took."""
    tokens, accepted, ends, requests, ids = {}, {}, {}, {}, []
    arrivals, aborts = list(arrivals), list(aborts)
    for step in range(max_steps):
        for at, prompt, params in arrivals:
            if at == step:
                ids.append(engine.add_request(prompt, params))
                requests[ids[-1]] = engine.requests[ids[-1]]
        for at, rid in aborts:
            if at == step:
                engine.abort(ids[rid])
        if not engine.has_work() and step > max(a[0] for a in arrivals):
            break
        for rid, event in engine.step().items():
            tokens.setdefault(rid, []).extend(event.tokens)
            accepted.setdefault(rid, []).extend(event.accepted)
            if event.finished_by:
                ends[rid] = event.finished_by
    return dict(tokens=[tokens.get(i, []) for i in ids], accepted=[accepted.get(i, []) for i in ids],
                ends=[ends.get(i) for i in ids], rows=[requests[i].row for i in ids])


def test_arrivals_mid_batch_reuse_rows_and_match_each_request_alone():
    decoder = make_decoder()
    lengths = [12, 5, 20, 9, 14, 7]
    alone = [dcp.generate_all(decoder, [p], n)[0] for p, n in zip(PROMPTS, lengths)]
    arrivals = [(at, p, SamplingParams(max_new_tokens=n)) for at, p, n in zip([0, 0, 2, 3, 3, 9], PROMPTS, lengths)]
    out = run(SpecEngine(decoder), arrivals)
    assert out["tokens"] == [a.tokens for a in alone]
    assert out["accepted"] == [a.accepted for a in alone]
    assert out["ends"] == ["length"] * 6
    # six requests through three rows: rows were freed and taken again
    assert sorted(set(out["rows"])) == [0, 1, 2] and len(out["rows"]) == 6


def test_abort_frees_the_row_for_the_next_request():
    decoder = make_decoder(max_batch=2)
    alone = [dcp.generate_all(decoder, [p], 15)[0].tokens for p in PROMPTS[:4]]
    params = SamplingParams(max_new_tokens=15)
    # request 0 is aborted while running, request 3 while still queued
    out = run(SpecEngine(decoder), [(0, p, params) for p in PROMPTS[:4]], aborts=[(2, 0), (2, 3)])
    assert out["ends"] == ["aborted", "length", "length", "aborted"]
    assert out["tokens"][0] == alone[0][: len(out["tokens"][0])] and len(out["tokens"][0]) < 15
    assert out["tokens"][1:3] == alone[1:3] and out["tokens"][3] == []
    assert out["rows"][2] == out["rows"][0]  # the aborted request's row went to the next one


def test_eos_ends_a_request_and_its_row_goes_to_the_queue():
    decoder = make_decoder(max_batch=1)
    full = dcp.generate_all(decoder, [PROMPTS[0]], 20)[0].tokens
    eos = full[3]
    out = run(SpecEngine(decoder), [(0, PROMPTS[0], SamplingParams(max_new_tokens=20, eos_id=eos)),
                                    (0, PROMPTS[1], SamplingParams(max_new_tokens=6))])
    assert out["ends"] == ["eos", "length"]
    assert out["tokens"][0] == full[: full.index(eos) + 1]
    assert out["tokens"][1] == dcp.generate_all(decoder, [PROMPTS[1]], 6)[0].tokens


def test_stop_ids_end_every_request_as_its_own_eos_does():
    """A model with several EOS ids (Llama-3: end of text, end of turn): the engine's
    ``stop_ids`` apply to every request, together with the request's own ``eos_id``:
    at the first token, or part-way, where the device ends the row."""
    decoder = make_decoder(max_batch=2)
    prompts = [PROMPTS[4], PROMPTS[1], [1, 9, 4, 17, 2, 30]]
    full = [dcp.generate_all(decoder, [p], 20)[0].tokens for p in prompts]
    stops = frozenset({full[0][9], full[2][0]})  # part-way through the first, the third's first token
    own = [full[1][0] ^ 1, None, None]  # a row holding both stop ids and an eos_id of its own
    assert full[0][9] not in full[0][:9] and own[0] not in full[0] + full[1] and full[2][0] not in full[1]
    engine = SpecEngine(decoder, stop_ids=stops)
    # `dcp-compile serve` warms its engine up with the stop ids cleared, then restores them:
    # the rows' state must still hold them all (and the request's own eos_id).
    engine.stop_ids = frozenset()
    run(engine, [(0, PROMPTS[0], SamplingParams(max_new_tokens=5))])
    engine.stop_ids = stops
    out = run(engine, [(0, p, SamplingParams(max_new_tokens=20, eos_id=e)) for p, e in zip(prompts, own)])
    expected = [cut_at_stop(f, stops | ({e} if e is not None else set())) for f, e in zip(full, own)]
    assert out["tokens"] == [tokens for tokens, _ in expected]  # the EOS token itself included
    assert out["ends"] == ["eos", "length", "eos"] and [len(t) for t in out["tokens"]] == [10, 20, 1]
    with pytest.raises(ValueError, match=r"stop_ids must be token ids in \[0, 32\), got \[32\]"):
        SpecEngine(decoder, stop_ids=frozenset({3, 32}))


def test_cut_at_stop():
    assert cut_at_stop([5, 7, 9, 7], frozenset({7, 9})) == ([5, 7], True)
    assert cut_at_stop([5, 6], frozenset({7})) == ([5, 6], False)
    assert cut_at_stop([], frozenset({7})) == ([], False)


def test_a_seeded_request_samples_the_same_tokens_in_any_batch():
    decoder = make_decoder(temperature=0.9)
    seeded = SamplingParams(max_new_tokens=16, temperature=5.0, seed=1234)
    alone = run(SpecEngine(decoder), [(0, PROMPTS[1], seeded)])["tokens"][0]
    crowded = run(SpecEngine(decoder), [(0, PROMPTS[0], SamplingParams(max_new_tokens=16)),
                                        (0, PROMPTS[2], SamplingParams(max_new_tokens=16, temperature=0.0)),
                                        (1, PROMPTS[1], seeded)])
    assert crowded["tokens"][2] == alone
    # a greedy request in a sampling batch decodes as it would alone
    greedy_alone = dcp.generate_all(make_decoder(), [PROMPTS[2]], 16)[0].tokens
    assert crowded["tokens"][1] == greedy_alone
    other_seed = run(SpecEngine(decoder), [(0, PROMPTS[1], SamplingParams(max_new_tokens=16, temperature=5.0, seed=99))])["tokens"][0]
    assert other_seed != alone


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "empty prompt"),
    ("hello", SamplingParams(), "a prompt is a sequence of token ids, got str"),
    ([1, 2, 32], SamplingParams(), r"prompt token ids must be ints in \[0, 32\); got \[32\]"),
    ([1, 2.5], SamplingParams(), r"got \[2.5\]"),
    ([1], SamplingParams(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    ([1] * 90, SamplingParams(max_new_tokens=4), "needs 98 cache positions; the cache holds max_seq_len=96"),
    ([1], SamplingParams(temperature=-1.0), "temperature must be a finite number >= 0, got -1.0"),
    ([1], SamplingParams(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    ([1], SamplingParams(seed=-3), r"seed must be an int in \[0, 2\*\*63\), got -3"),
    ([1], SamplingParams(eos_id=40), r"eos_id must be a token id in \[0, 32\), got 40"),
])
def test_bad_requests_are_refused_and_leave_the_engine_idle(prompt, params, message):
    engine = SpecEngine(make_decoder())
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_work() and engine.next_id == 0


def test_arrivals_and_departures_never_recompile():
    from torch._dynamo.utils import counters

    decoder = make_decoder()
    engine = SpecEngine(decoder)
    run(engine, [(0, PROMPTS[0], SamplingParams(max_new_tokens=4))])
    compiled = dict(counters["stats"])
    assert compiled.get("unique_graphs", 0) > 0
    out = run(engine, [(at, p, SamplingParams(max_new_tokens=n, temperature=t)) for at, p, n, t in
                       zip([0, 1, 1, 4, 6, 6], PROMPTS, [9, 3, 15, 6, 11, 2], [0, 0.5, 0, 1.0, 0, 0.7])])
    assert all(e == "length" for e in out["ends"])
    assert dict(counters["stats"]) == compiled


def test_while_running_is_called_after_the_launch_and_before_the_last_step_is_read():
    decoder = make_decoder(max_batch=2)
    engine = SpecEngine(decoder)
    calls = []
    launch, collect = engine._launch, engine._collect
    engine._launch = lambda: calls.append("launch") or launch()
    engine._collect = lambda *a: calls.append("read") or collect(*a)
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=6))
    steps, tokens = 0, []
    while engine.has_work():
        events = engine.step(while_running=lambda: calls.append("caller"))
        tokens += [t for e in events.values() for t in e.tokens]
        steps += 1
    assert tokens == dcp.generate_all(decoder, [PROMPTS[0]], 6)[0].tokens
    # Once per step; after the step's launch and before the last one's tokens are read.
    assert calls.count("caller") == steps
    assert "launch, caller, read" in ", ".join(calls)
    for i, call in enumerate(calls):
        if call == "read":
            assert calls[i - 1] == "caller"


@pytest.mark.parametrize("size", [2, 3])
def test_leader_mode_ranks_agree_and_match_the_static_batch(size):
    arrivals = [0, 0, 1, 3, 5]
    ranks = spawn_ranks(engine_leader_worker, size, PROMPTS[:5], arrivals, 2, timeout=600)
    rank0 = ranks[0]
    for other in ranks[1:]:
        assert other["tokens"] == rank0["tokens"] and other["ends"] == rank0["ends"]
    assert rank0["ends"] == {0: "aborted", 1: "length", 2: "length", 3: "length", 4: "length"}
    for rid in range(1, 5):
        assert rank0["tokens"][rid] == rank0["static"][rid]
    assert rank0["tokens"][0] == rank0["static"][0][: len(rank0["tokens"][0])]


@pytest.mark.parametrize("chunks_per_step", [1, 2, None])
def test_a_long_prompt_is_prefilled_a_chunk_a_step_while_the_others_decode(chunks_per_step):
    target, draft = agreeing_pair("eagle3", noise=3.0, max_batch=2)
    decoder = dcp.SpecDecoder(target, draft, dcp.init_group("cpu"), k=3, max_batch=2, max_seq_len=96, chunk_size=4,
                              lowering="aot_eager")
    short, long = [1, 2, 3], [(7 * i) % 31 for i in range(19)]  # 19 tokens: five chunks of 4
    alone = [dcp.generate_all(decoder, [short], 60)[0].tokens, dcp.generate_all(decoder, [long], 24)[0].tokens]
    engine = SpecEngine(decoder, prefill_chunks_per_step=chunks_per_step)
    first = engine.add_request(short, SamplingParams(max_new_tokens=60))
    tokens, short_steps, second, first_long, step = {}, set(), None, None, 0
    while engine.has_work() or second is None:
        if step == 2:
            second = engine.add_request(long, SamplingParams(max_new_tokens=24))
        events = engine.step()
        for rid, event in events.items():
            tokens.setdefault(rid, []).extend(event.tokens)
        if events.get(first) and events[first].tokens:
            short_steps.add(step)
        if first_long is None and second in tokens:
            first_long = step
        step += 1
    assert tokens[first] == alone[0] and tokens[second] == alone[1]
    # the long prompt takes its first token after ceil(5 chunks / chunks a step) steps of prefill ...
    assert first_long == 2 + -(-5 // (chunks_per_step or 5)) - 1
    # ... and the short request decodes in every one of them
    assert set(range(first_long + 1)) <= short_steps
