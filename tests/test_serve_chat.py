"""`dcp-compile serve`'s HTTP side through the official ``openai`` client, in process.

The app ``build_app`` returns runs over the real ``Frontend`` and ``EngineLoop`` (in a
thread, through the pipes the server's two processes use) and a real codec (tokenizers
trained offline, ``tests/support/text.py``); the engine is a scripted fake
that answers every prompt with the same token ids, so the texts, ends and token counts
are known exactly.  What the engine itself does is tested in tests/runtime; the server
against the shipped pair on 2 ranks in tests/test_serve.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from types import SimpleNamespace

import openai
import pytest
from starlette.testclient import TestClient

from dcp_compile.runtime.engine import SamplingParams, SpecEngine, StepEvent, cut_at_stop
from dcp_compile.serve.engine import serve_in_thread
from dcp_compile.serve.http import build_app
from dcp_compile.text import ByteCodec, HFCodec
from tests.support.text import tokenizer_dir

MODEL = "tiny-chat"
REPLY = "Bonjour, ça va? 🙂 Très bien. 👍 €"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Salut!"}]


class ScriptedEngine:
    """The part of ``SpecEngine`` the engine loop drives: every request decodes
    ``script(prompt)``, ``per_step`` tokens a step, and ends at the first of ``stop_ids``
    (that token kept, as ``SpecEngine`` keeps it) or after ``max_new_tokens``."""

    def __init__(self, script: Callable[[list[int]], list[int]], *, vocab: int, stop_ids: frozenset[int],
                 per_step: int = 2, step_seconds: float = 0.001, max_seq_len: int = 256, k: int = 3):
        self.script, self.vocab, self.stop_ids, self.per_step = script, vocab, stop_ids, per_step
        self.step_seconds = step_seconds
        self.max_seq_len, self.k = max_seq_len, k
        self.pages = None  # rows of max_seq_len, no pool
        self.decoder = SimpleNamespace(temperature=0.0, graph_runners=[])
        self.requests: dict[int, dict] = {}
        self.waiting: list = []
        self.aborted: list[int] = []
        self.stats = dict(verify_steps=0, row_steps=0, accepted=0, step_seconds=0.0)
        self.next_id = 0
        self.stopped = False
        self.batch_sizes: list[int] = []
        """Requests each step served."""

    limits = SpecEngine.limits  # the real refusals: vocabulary, cache room, temperature
    check_request = SpecEngine.check_request

    def add_request(self, prompt, params: SamplingParams) -> int:
        self.check_request(prompt, params)
        self.requests[self.next_id] = dict(tokens=self.script(list(prompt)), params=params, sent=0)
        self.next_id += 1
        return self.next_id - 1

    def abort(self, request_id: int) -> bool:
        self.aborted.append(request_id)
        return self.requests.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def running(self) -> int:
        return len(self.requests)

    rows = 8

    @property
    def free_rows(self) -> int:
        return self.rows - len(self.requests)

    def step(self, while_running=None) -> dict[int, StepEvent]:
        if while_running is not None:  # where SpecEngine calls it: the step launched, the last not yet read
            while_running()
        events = {}
        for rid, request in list(self.requests.items()):
            n = request["params"].max_new_tokens
            fresh = request["tokens"][request["sent"]:][: min(self.per_step, n - request["sent"])]
            fresh, ended = cut_at_stop(fresh, self.stop_ids)
            request["sent"] += len(fresh)
            finished_by = "eos" if ended else "length" if request["sent"] >= n else None
            events[rid] = StepEvent(tokens=fresh, finished_by=finished_by)
            if finished_by:
                del self.requests[rid]
        self.stats["verify_steps"] += 1
        self.batch_sizes.append(len(events))
        time.sleep(self.step_seconds)
        return events

    def shutdown(self) -> None:
        self.stopped = True


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: tokenizer_dir(root / family, family) for family in ("byte_level", "sentencepiece")} | {
        "no_template": tokenizer_dir(root / "base", chat_template=None)}


def reply_ids(codec) -> list[int]:
    """The scripted answer: ``REPLY``, then an EOS, then what the model would say past it."""
    if isinstance(codec, ByteCodec):
        return list(REPLY.encode()) + [0] + list(b"never")
    tokenizer = codec.tokenizer
    return tokenizer.encode(REPLY, add_special_tokens=False) + [min(codec.eos_ids)] \
        + tokenizer.encode(" never", add_special_tokens=False)


class Server:
    def __init__(self, codec, **engine_options):
        self.codec = codec
        self.reply = reply_ids(codec)
        vocab = 256 if isinstance(codec, ByteCodec) else len(codec.tokenizer)
        self.engine = ScriptedEngine(lambda prompt: self.reply, vocab=vocab, stop_ids=codec.eos_ids, **engine_options)
        self.worker = serve_in_thread(self.engine, step_timeout=60)
        self.http = TestClient(build_app(self.worker, codec, MODEL))

    def __enter__(self):
        self.worker.start()
        self.http.__enter__()
        self.client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=self.http, max_retries=0)
        return self

    def __exit__(self, *exc):
        self.http.__exit__(*exc)
        self.worker.close(drain_seconds=1)

    def text_after(self, prompt: list[int], n: int | None = None) -> str:
        """The completion of ``prompt`` by the first ``n`` reply tokens (to the EOS if None)."""
        eos = next(i for i, t in enumerate(self.reply) if t in self.codec.eos_ids)
        reply = self.reply[: eos if n is None else min(n, eos)]
        if isinstance(self.codec, ByteCodec):
            return bytes(reply).decode("utf-8", "replace")
        return self.codec.decode(prompt + reply)[len(self.codec.decode(prompt)):]


@pytest.fixture(params=["byte_level", "sentencepiece"])
def server(request, tokenizers):
    with Server(HFCodec(tokenizers[request.param])) as server:
        yield server


def test_a_chat_completion(server):
    response = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=3)
    prompt = server.codec.chat_ids(MESSAGES)
    choice = response.choices[0]
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion" and response.model == MODEL
    assert choice.message.role == "assistant" and choice.finish_reason == "stop" and choice.index == 0
    assert choice.message.content == server.text_after(prompt) and "🙂" in choice.message.content
    eos = next(i for i, t in enumerate(server.reply) if t in server.codec.eos_ids)
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), eos + 1)  # the EOS counts, as generated
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_chat_completion_that_runs_out_of_tokens_ends_by_length(server):
    prompt = server.codec.chat_ids(MESSAGES)
    for limit in (dict(max_tokens=5), dict(max_completion_tokens=5)):
        response = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, **limit)
        assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 5
        assert response.choices[0].message.content == server.text_after(prompt, 5)
    with pytest.raises(openai.BadRequestError, match="'max_completion_tokens' and its deprecated alias 'max_tokens'"):
        server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, max_completion_tokens=6)


@pytest.mark.parametrize("per_step", [1, 3])
def test_a_streamed_chat_completion(tokenizers, per_step):
    with Server(HFCodec(tokenizers["byte_level"]), per_step=per_step) as server:
        chunks = list(server.client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                            stream_options={"include_usage": True}))
        prompt = server.codec.chat_ids(MESSAGES)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    *body, end, usage = chunks
    contents = [c.choices[0].delta.content for c in body[1:]]
    # one character of several bytes over several tokens is never sent in parts
    assert all(contents) and not any("\ufffd" in c for c in contents)
    assert "".join(contents) == server.text_after(prompt)
    assert [c.choices[0].finish_reason for c in body] == [None] * len(body)
    assert end.choices[0].finish_reason == "stop" and not end.choices[0].delta.content
    assert all(c.usage is None for c in body + [end])
    assert usage.choices == [] and usage.usage.prompt_tokens == len(prompt) and usage.usage.completion_tokens > 0


def test_a_streamed_chat_completion_without_usage_ends_by_length(server):
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=4))
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None and c.choices for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == server.text_after(server.codec.chat_ids(MESSAGES), 4)


def test_completions_with_usage_and_stop_strings(server):
    client, prompt = server.client, "Bonjour"
    ids = server.codec.encode(prompt)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=100)
    choice = response.choices[0]
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert choice.text == server.text_after(ids) and choice.finish_reason == "stop"
    assert response.usage.prompt_tokens == len(ids)  # the tokenizer's BOS included where it adds one
    short = client.completions.create(model=MODEL, prompt=ids, max_tokens=3)  # token ids as the prompt
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert short.choices[0].text == server.text_after(ids, 3)
    before = len(server.engine.aborted)
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=100, stop=["va?"])
    assert cut.choices[0].text == choice.text[: choice.text.index("va?")] and cut.choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 10
    while len(server.engine.aborted) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(server.engine.aborted) == before + 1, "the stop string frees the row, not only ends the text"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=100, stop="va?", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == cut.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)


def test_models_lists_the_served_model(server):
    models = server.client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "dcp-compile")]
    assert models[0].created > 0


def test_bad_requests_get_400(server):
    client = server.client
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\['role'\] must be one of"):
        client.chat.completions.create(model=MODEL, messages=[MESSAGES[0], {"role": "bot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="'messages' must be a non-empty list"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match=r"prompt token ids must be ints in \[0, "):
        client.completions.create(model=MODEL, prompt=[server.engine.vocab + 5])
    with pytest.raises(openai.BadRequestError, match="'stream_options' is only allowed with 'stream': true"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2)
    with pytest.raises(openai.BadRequestError, match=r"unsupported fields \['tools'\]"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    # a chat without max_tokens may use what the prompt leaves of the cache, no more
    long = [{"role": "user", "content": "x " * 400}]
    for call in (lambda: client.chat.completions.create(model="gpt-4o", messages=MESSAGES),
                 lambda: client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)):
        with pytest.raises(openai.NotFoundError, match=f"The model 'gpt-4o' does not exist: this server serves '{MODEL}'") as found:
            call()
        assert found.value.code == "model_not_found" and found.value.status_code == 404
    with pytest.raises(openai.BadRequestError, match="the cache holds max_seq_len=256"):
        client.chat.completions.create(model=MODEL, messages=long)


@pytest.mark.parametrize("model", ["bytes", "no_template"])
def test_chat_with_a_model_without_a_chat_template_is_a_400_naming_it(model, tokenizers):
    codec = ByteCodec() if model == "bytes" else HFCodec(tokenizers["no_template"])
    with Server(codec) as server:
        expected = "the shipped byte-level model has no chat template" if model == "bytes" else \
            f"the tokenizer in {tokenizers['no_template']} has no chat template"
        with pytest.raises(openai.BadRequestError, match=expected):
            server.client.chat.completions.create(model=MODEL, messages=MESSAGES)
        # completions still work
        response = server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=100)
        assert response.choices[0].text == server.text_after(codec.encode("Hi"))
        assert response.choices[0].finish_reason == "stop"


def test_a_client_that_leaves_a_stream_aborts_its_request(tokenizers):
    with Server(HFCodec(tokenizers["byte_level"]), per_step=1, step_seconds=0.02) as server:
        server.reply = server.reply[:1] * 200  # never an EOS
        with server.http.stream("POST", "/v1/chat/completions",
                                json=dict(model=MODEL, messages=MESSAGES, stream=True, max_tokens=150)) as response:
            lines = response.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert first["choices"][0]["delta"]["role"] == "assistant"
        # The role chunk can reach the client before the engine has taken the request: wait
        # for the abort itself, not for an engine that merely looks idle.
        deadline = time.monotonic() + 10
        while not (server.engine.aborted and not server.engine.running) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.engine.aborted == [0] and not server.engine.running
        assert server.http.get("/health").json()["status"] == "ok"


def _burst(window: float, rows: int, arrivals: int) -> tuple[ScriptedEngine, list[float]]:
    """``arrivals`` requests 5 ms apart into an idle engine thread; returns the engine and
    how long after the last arrival the first step began."""
    import asyncio
    import threading

    from dcp_compile.serve.requests import Completion

    engine = ScriptedEngine(lambda prompt: [65] * 4, vocab=256, stop_ids=frozenset(), per_step=4)
    engine.rows = rows
    first_step = []
    step = engine.step
    engine.step = lambda **kw: (first_step.append(time.monotonic()) if not first_step else None, step(**kw))[1]
    worker = serve_in_thread(engine, step_timeout=60, admission_window=window)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    worker.start()
    last = 0.0
    for _ in range(arrivals):
        completion = Completion([1, 2, 3], SamplingParams(max_new_tokens=4), [], False, MODEL, ByteCodec().decoder())
        completion.loop, completion.events = loop, asyncio.Queue()
        worker.submit(completion)
        last = time.monotonic()
        time.sleep(0.005)
    deadline = time.monotonic() + 10
    while len(engine.batch_sizes) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.close(drain_seconds=1)
    loop.call_soon_threadsafe(loop.stop)
    return engine, [first_step[0] - last]


def test_an_idle_engine_gathers_a_burst_into_its_first_prefill():
    engine, _ = _burst(window=0.5, rows=8, arrivals=4)
    assert engine.batch_sizes[0] == 4, "four arrivals 5 ms apart share the first step"


def test_the_window_ends_once_the_rows_are_taken():
    engine, (after_last,) = _burst(window=5.0, rows=2, arrivals=2)
    assert engine.batch_sizes[0] == 2 and after_last < 2.0, "no wait for arrivals that could not be admitted"


def test_the_engine_stops_when_the_http_process_goes_away():
    """The HTTP process's ends of the pipes closing (it died) end the engine loop: what
    runs is aborted, the followers are stopped, and the loop reports a failure (the
    server exits 1)."""
    import threading
    from multiprocessing import Pipe

    from dcp_compile.serve.engine import EngineLoop

    engine = ScriptedEngine(lambda prompt: [65] * 1000, vocab=256, stop_ids=frozenset(), per_step=1)
    requests_in, requests_out = Pipe(duplex=False)
    events_in, events_out = Pipe(duplex=False)
    loop = EngineLoop(engine, requests_in, events_out, step_timeout=60)
    result = []
    thread = threading.Thread(target=lambda: result.append(loop.run()), daemon=True)
    thread.start()
    requests_out.send(("add", 7, [1, 2, 3], SamplingParams(max_new_tokens=200)))
    assert events_in.recv()[0][:3] == ("tokens", 7, [65])  # it runs
    requests_out.close()
    events_in.close()
    thread.join(timeout=10)
    assert result == ["the HTTP process ended"] and engine.aborted == [0] and engine.stopped


def test_a_running_engine_serves_its_pipes_only_while_a_step_runs():
    """The loop sends tokens and reads requests from inside each step, once it is launched
    (``SpecEngine.step``'s ``while_running``), never between two steps while the engine has
    work: there it would delay the next launch.  Every token still arrives, in order."""
    import threading
    from multiprocessing import Pipe

    from dcp_compile.serve.engine import EngineLoop

    engine = ScriptedEngine(lambda prompt: list(range(60, 80)), vocab=256, stop_ids=frozenset(), per_step=3)
    trace = []
    step = engine.step

    def traced_step(while_running=None):
        def inside():
            trace.append("in")
            while_running()
            trace.append("out")
        trace.append(("step", engine.has_work()))
        return step(while_running=inside if while_running else None)

    engine.step = traced_step
    requests_in, requests_out = Pipe(duplex=False)
    events_in, events_out = Pipe(duplex=False)
    polls, receive = [], requests_in.poll
    requests_in = SimpleNamespace(poll=lambda timeout=0.0: polls.append(len(trace)) or receive(timeout),
                                  recv=requests_in.recv)
    sent = SimpleNamespace(send=lambda batch: trace.append("send") or events_out.send(batch))
    loop = EngineLoop(engine, requests_in, sent, step_timeout=60)
    threading.Thread(target=loop.run, daemon=True).start()
    requests_out.send(("add", 1, [1, 2], SamplingParams(max_new_tokens=17)))
    tokens, ends = [], []
    while not ends:
        for kind, *message in events_in.recv():
            assert kind != "failed", message
            if kind == "tokens":
                tokens += message[1]
                ends += [message[2]] if message[2] else []
    requests_out.send(("drain", 1.0))
    while ("closed",) not in events_in.recv():
        pass
    assert tokens == list(range(60, 77)) and ends == ["length"]
    # Between a running step's end and the next one's start: no send and no read of the pipe.
    steps = [i for i, t in enumerate(trace) if isinstance(t, tuple)]
    assert len([i for i in steps if trace[i][1]]) >= 5 and trace.count("send") >= 5
    for start, end in zip(steps, steps[1:]):
        if trace[start][1] and trace[end][1]:  # two steps back to back with work
            inside = range(trace.index("in", start) + 1, trace.index("out", start) + 1)
            sends = [i for i in range(start, end) if trace[i] == "send"]
            # ``polls`` holds the trace's length at each poll: it came after trace[p - 1]
            assert all(i in inside for i in sends)
            assert all(p in inside for p in polls if start < p <= end)
