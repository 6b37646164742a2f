"""``dcp-compile serve``: an OpenAI-compatible server over a ``SpecEngine``.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (each streamed or not, with
``usage`` and ``finish_reason``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Rank 0 serves HTTP (Starlette on uvicorn) and runs the engine in one thread of its own;
the other ranks run the engine's follower loop.  The engine thread is the only code that
touches the engine: HTTP handlers hand it requests and aborts through a queue, and it
hands tokens back to each request's asyncio queue.

The model's codec (``dcp_compile.text``) turns text into token ids and back: a prompt is
text or a list of token ids, chat messages go through the tokenizer's chat template,
and a completion's text streams through an incremental decoder.  The shipped byte-level
models read and write UTF-8 bytes and have no chat template (chat requests get a 400);
a Hugging Face model brings its tokenizer.  Generation ends at any of the model's EOS
ids (the engine's ``stop_ids``), at ``max_tokens`` or at a stop string.

Failure behaviour:
- a bad request (malformed JSON, a prompt longer than the cache, ``max_tokens < 1``, a
  field of the wrong type or one this server does not implement) gets a 400 naming the
  problem, and no other request notices;
- a client that disconnects mid-stream has its row freed at the next step;
- SIGTERM (or SIGINT): stop admitting, let running requests finish for up to
  ``--drain-seconds``, abort the rest, stop the followers, exit 0;
- a rank that dies or hangs: the step's collective fails (at once for a dead peer; after
  ``--collective-timeout`` for one that hangs while the batch is idle or between steps)
  or the step watchdog fires (``--step-timeout``, a rank that hangs inside a step); every
  open request gets an error, ``/health`` answers 503, and the server exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType

import torch

from dcp_compile.runtime.engine import SamplingParams, SpecEngine
from dcp_compile.text import Codec, IncrementalDecoder

_COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "seed", "stop", "stream", "stream_options", "n",
                            "user"})
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens"}
_FINISH_REASONS = MappingProxyType({"eos": "stop", "length": "length"})
HEARTBEAT_SECONDS = 0.5
"""An idle leader still steps (one small broadcast) this often, so the followers' waits
stay far inside the collective timeout."""


class BadRequest(ValueError):
    """A request the server refuses with 400."""


@dataclass
class Completion:
    """One request (a completion or a chat completion) as the HTTP side sees it."""

    prompt: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    model: str
    decoder: IncrementalDecoder
    chat: bool = False
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk carries the usage."""
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    engine_id: int | None = None
    # engine-thread side
    text: str = ""
    sent: int = 0
    tokens: int = 0
    done: bool = False

    def __post_init__(self):
        if not self.id:
            self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": self.tokens,
                "total_tokens": len(self.prompt) + self.tokens}


def _type_error(name: str, expected: str, value) -> BadRequest:
    return BadRequest(f"'{name}' must be {expected}, got {type(value).__name__} {value!r:.60}")


def _check_fields(body, fields: frozenset[str]) -> None:
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(f"unsupported fields {unknown}: this server implements {sorted(fields)}")


def _options(body: dict, name: str, max_tokens) -> tuple[SamplingParams, list[str], bool, bool]:
    """The sampling params, stop strings, ``stream`` and ``include_usage`` of a request
    whose ``max_tokens`` (read from field ``name``) is given."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _type_error(name, "an integer", max_tokens)
    if max_tokens < 1:
        raise BadRequest(f"'{name}' must be >= 1, got {max_tokens}")
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise _type_error("temperature", "a number", temperature)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _type_error("seed", "an integer", seed)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise _type_error("stop", "a non-empty string or a list of up to 4 of them", stop)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _type_error("stream", "a boolean", stream)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true")
    options = options or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} \
            or not isinstance(options.get("include_usage", False), bool):
        raise _type_error("stream_options", 'an object {"include_usage": a boolean}', options)
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest(f"'n' must be 1 (one completion per request), got {n!r}")
    # No eos_id: the engine's stop_ids (the codec's EOS ids) end every request.
    params = SamplingParams(max_new_tokens=max_tokens, temperature=None if temperature is None else float(temperature),
                            seed=seed)
    return params, stop, stream, options.get("include_usage", False)


def parse_completion(body, model: str, codec: Codec) -> Completion:
    """A ``/v1/completions`` body as a ``Completion``, or ``BadRequest`` saying what is wrong."""
    _check_fields(body, _COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        tokens = codec.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        tokens = prompt  # ids: the engine checks them against the vocabulary
    else:
        raise _type_error("prompt", "a string or a list of token ids", prompt)
    max_tokens = body.get("max_tokens")
    params, stop, stream, include_usage = _options(body, "max_tokens", 16 if max_tokens is None else max_tokens)
    return Completion(tokens, params, stop, stream, str(body.get("model") or model), codec.decoder(tokens),
                      include_usage=include_usage)


def parse_chat(body, model: str, codec: Codec, *, context: int) -> Completion:
    """A ``/v1/chat/completions`` body as a ``Completion`` of the rendered conversation, or
    ``ValueError`` saying what is wrong (a model without a chat template included).
    ``context``: the positions a prompt and its completion may take together; without
    ``max_tokens`` the completion may use what the prompt leaves of it."""
    _check_fields(body, _CHAT_FIELDS)
    tokens = codec.chat_ids(body.get("messages"))
    given = {name: body[name] for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise BadRequest(f"'max_completion_tokens' and its deprecated alias 'max_tokens' disagree: {given}")
    name, max_tokens = next(iter(given.items()), ("max_tokens", max(1, context - len(tokens))))
    params, stop, stream, include_usage = _options(body, name, max_tokens)
    return Completion(tokens, params, stop, stream, str(body.get("model") or model), codec.decoder(tokens), chat=True,
                      include_usage=include_usage)


def _deliver(batch: list[tuple[Completion, tuple]]) -> None:
    for completion, item in batch:
        completion.events.put_nowait(item)


class EngineThread:
    """The one thread that drives the engine on rank 0."""

    def __init__(self, engine: SpecEngine, *, step_timeout: float, admission_window: float = 0.0):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.by_engine_id: dict[int, Completion] = {}
        self.outbox: list[tuple[Completion, tuple]] = []
        self.failure: str | None = None
        self.draining = False
        self.closed = threading.Event()
        self.step_timeout = step_timeout
        self.admission_window = admission_window
        """Seconds an idle engine waits, after a request arrives, for more to join its
        first prefill: every prefill chunk costs one ``[max_batch, chunk_size]`` step
        however many rows it fills, so a burst that refills a drained batch should
        share one."""
        self.step_started: float | None = None
        self.metrics = dict(requests=0, finished=0, tokens=0)
        self.thread = threading.Thread(target=self._run, name="dcp-engine", daemon=True)
        self.on_failure = lambda: None

    def start(self) -> None:
        self.thread.start()
        threading.Thread(target=self._watchdog, name="dcp-step-watchdog", daemon=True).start()

    # ---- called from the HTTP side

    def submit(self, completion: Completion) -> None:
        self.inbox.put(("add", completion))

    def cancel(self, completion: Completion) -> None:
        self.inbox.put(("abort", completion))

    def close(self, drain_seconds: float) -> None:
        """Stop admitting; abort what is still running after ``drain_seconds``; stop the
        followers; return when the engine thread has ended."""
        self.draining = True
        self.inbox.put(("drain", time.monotonic() + drain_seconds))
        self.closed.wait(timeout=drain_seconds + self.step_timeout + 10)

    # ---- the engine thread

    def _send(self, completion: Completion, item) -> None:
        self.outbox.append((completion, item))

    def _flush(self) -> None:
        """Hand the step's items to the event loop in one wake-up, not one per request."""
        if self.outbox:
            batch, self.outbox = self.outbox, []
            batch[0][0].loop.call_soon_threadsafe(_deliver, batch)

    def _finish(self, completion: Completion, reason: str) -> None:
        completion.done = True
        self.by_engine_id.pop(completion.engine_id, None)
        self.metrics["finished"] += 1
        self._send(completion, ("text", completion.text[completion.sent:], reason))
        completion.sent = len(completion.text)

    def _tokens(self, completion: Completion, tokens: list[int], finished_by: str | None) -> None:
        if completion.done:
            return
        completion.tokens += len(tokens)
        self.metrics["tokens"] += len(tokens)
        completion.text += completion.decoder.push(tokens)  # the decoder leaves EOS ids out
        if finished_by is not None:
            completion.text += completion.decoder.finish()
        hits = [completion.text.find(s, max(0, completion.sent - len(s))) for s in completion.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            completion.text = completion.text[: min(hits)]
            if not finished_by:
                self.engine.abort(completion.engine_id)
            self._finish(completion, "stop")
        elif finished_by:
            self._finish(completion, _FINISH_REASONS.get(finished_by, finished_by))
        else:
            # Hold back what could be the start of a stop string.
            safe = len(completion.text) - max((len(s) - 1 for s in completion.stop), default=0)
            if safe > completion.sent:
                self._send(completion, ("text", completion.text[completion.sent:safe], None))
                completion.sent = safe

    def _take(self, block: bool, deadline: float | None) -> float | None:
        idle = not self.engine.has_work()
        gather_until = None
        while True:
            timeout = HEARTBEAT_SECONDS if block else None
            if gather_until is not None and self.engine.free_rows > 0:
                block, timeout = True, max(0.0, gather_until - time.monotonic())
            try:
                kind, value = self.inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return deadline
            block = False
            if kind == "add" and idle and gather_until is None and self.admission_window > 0:
                gather_until = time.monotonic() + self.admission_window
            if kind == "add":
                if self.draining or self.failure:
                    self._send(value, ("error", "the server is shutting down"))
                    continue
                value.engine_id = self.engine.add_request(value.prompt, value.params)
                self.by_engine_id[value.engine_id] = value
                self.metrics["requests"] += 1
            elif kind == "abort":
                if not value.done and value.engine_id is not None:
                    value.done = True
                    self.by_engine_id.pop(value.engine_id, None)
                    self.engine.abort(value.engine_id)
            elif kind == "drain":
                deadline = value

    def _run(self) -> None:
        deadline = None
        try:
            while True:
                deadline = self._take(block=not self.engine.has_work(), deadline=deadline)
                if deadline is not None and (not self.engine.has_work() or time.monotonic() > deadline):
                    for completion in list(self.by_engine_id.values()):
                        self.engine.abort(completion.engine_id)
                        self._finish(completion, "abort")
                    while self.engine.has_work():
                        self._step()
                    self._flush()
                    self.engine.shutdown()
                    return
                self._step()
                self._flush()
        except BaseException as error:  # a failed collective, a dead peer: nothing more can run
            self.failure = f"{type(error).__name__}: {error}"
            print(f"dcp-compile serve: the engine stopped: {self.failure}", file=sys.stderr, flush=True)
            self.outbox = []
            for completion in list(self.by_engine_id.values()):
                self._send(completion, ("error", f"the engine failed: {self.failure}"))
            self._flush()
            self.on_failure()
        finally:
            self.closed.set()

    def _step(self) -> None:
        self.step_started = time.monotonic()
        events = self.engine.step()
        self.step_started = None
        for engine_id, event in events.items():
            completion = self.by_engine_id.get(engine_id)
            if completion is not None:
                self._tokens(completion, event.tokens, event.finished_by)

    def _watchdog(self) -> None:
        while not self.closed.is_set():
            started = self.step_started
            if started is not None and time.monotonic() - started > self.step_timeout:
                self.failure = f"a step ran longer than --step-timeout {self.step_timeout:.0f}s (a rank hangs?)"
                print(f"dcp-compile serve: {self.failure}; exiting", file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(0.5)

    def metrics_text(self) -> str:
        from torch._dynamo.utils import counters

        stats = self.engine.stats
        steps, row_steps = stats["verify_steps"], stats["row_steps"]
        lines = {
            "dcp_requests_total": self.metrics["requests"],
            "dcp_requests_finished_total": self.metrics["finished"],
            "dcp_requests_running": self.engine.running,
            "dcp_requests_waiting": len(self.engine.waiting),
            "dcp_tokens_total": self.metrics["tokens"],
            "dcp_verify_steps_total": steps,
            "dcp_mean_accept_length": round(stats["accepted"] / row_steps + 1, 4) if row_steps else 0.0,
            "dcp_step_seconds_total": round(stats["step_seconds"], 6),
            # Steady state: arrivals and departures must leave these two unchanged.
            "dcp_compiles_total": counters["stats"].get("unique_graphs", 0),
            "dcp_graph_captures_total": sum(r.captures for r in self.engine.decoder.graph_runners),
        }
        return "".join(f"{name} {value}\n" for name, value in lines.items())


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _completion_chunks(completion: Completion, text: str, reason: str | None) -> list[dict]:
    """A streamed completion's chunks for ``text`` (and its end, when ``reason``)."""
    if not (text or reason):
        return []
    return [{"id": completion.id, "object": "text_completion", "created": completion.created,
             "model": completion.model, "choices": [{"index": 0, "text": text, "finish_reason": reason}]}]


def _chat_chunk(completion: Completion, delta: dict, reason: str | None) -> dict:
    return {"id": completion.id, "object": "chat.completion.chunk", "created": completion.created,
            "model": completion.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}


def _chat_chunks(completion: Completion, text: str, reason: str | None) -> list[dict]:
    """A streamed chat completion's chunks: the text as a ``delta``, then (as OpenAI
    sends it) the end in a chunk of its own with an empty delta."""
    return ([_chat_chunk(completion, {"content": text}, None)] if text else []) \
        + ([_chat_chunk(completion, {}, reason)] if reason else [])


def _usage_chunk(completion: Completion) -> dict:
    """``stream_options.include_usage``: the last chunk, with no choices."""
    return {"id": completion.id, "object": "chat.completion.chunk" if completion.chat else "text_completion",
            "created": completion.created, "model": completion.model, "choices": [], "usage": completion.usage()}


def _response(completion: Completion, text: str, reason: str) -> dict:
    """A whole (not streamed) response."""
    head = {"id": completion.id, "created": completion.created, "model": completion.model}
    if completion.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
        return dict(head, object="chat.completion", choices=[choice], usage=completion.usage())
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return dict(head, object="text_completion", choices=[choice], usage=completion.usage())


def build_app(worker: EngineThread, codec: Codec, model_name: str):
    """The HTTP side: routes over ``worker``, prompts and texts through ``codec``, and
    ``model_name`` as the one model ``/v1/models`` lists."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    started = int(time.time())

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)

    async def run(request: Request, parse):
        if worker.failure:
            return error(503, f"the engine failed: {worker.failure}", "server_error")
        if worker.draining:
            return error(503, "the server is shutting down", "server_error")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as bad:
            return error(400, f"the body is not valid JSON: {bad}")
        try:
            completion = parse(body)
            worker.engine.check_request(completion.prompt, completion.params)
        except ValueError as bad:
            return error(400, str(bad))
        completion.loop, completion.events = asyncio.get_running_loop(), asyncio.Queue()
        worker.submit(completion)
        if completion.stream:
            return StreamingResponse(stream(completion), media_type="text/event-stream")
        text, reason = "", None
        try:
            while reason is None:
                kind, *rest = await completion.events.get()
                if kind == "error":
                    return error(503, rest[0], "server_error")
                text += rest[0]
                reason = rest[1]
        except asyncio.CancelledError:
            worker.cancel(completion)
            raise
        return JSONResponse(_response(completion, text, reason))

    async def stream(completion: Completion):
        chunks = _chat_chunks if completion.chat else _completion_chunks
        # With include_usage every chunk has a usage field (null), and the last one,
        # with no choices, the request's usage.
        usage = {"usage": None} if completion.include_usage else {}
        finished = False
        try:
            if completion.chat:
                yield _sse(dict(_chat_chunk(completion, {"role": "assistant", "content": ""}, None), **usage))
            while True:
                kind, *rest = await completion.events.get()
                # Whatever else has arrived goes out in the same chunk.
                while kind == "text" and rest[1] is None and not completion.events.empty():
                    next_kind, *next_rest = completion.events.get_nowait()
                    if next_kind != "text":
                        kind, rest = next_kind, next_rest
                        break
                    rest = [rest[0] + next_rest[0], next_rest[1]]
                if kind == "error":
                    yield _sse({"error": {"message": rest[0], "type": "server_error"}})
                    finished = True
                    return
                text, reason = rest
                for chunk in chunks(completion, text, reason):
                    yield _sse(dict(chunk, **usage))
                if reason:
                    finished = True
                    if completion.include_usage:
                        yield _sse(_usage_chunk(completion))
                    yield _sse("[DONE]")
                    return
        finally:
            if not finished:  # the client went away
                worker.cancel(completion)

    async def completions(request: Request):
        return await run(request, lambda body: parse_completion(body, model_name, codec))

    async def chat_completions(request: Request):
        context = worker.engine.max_seq_len - worker.engine.k - 1
        return await run(request, lambda body: parse_chat(body, model_name, codec, context=context))

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": started, "owned_by": "dcp-compile"}]})

    async def health(request: Request):
        if worker.failure:
            return error(503, f"the engine failed: {worker.failure}", "server_error")
        if worker.draining:
            return error(503, "the server is shutting down", "server_error")
        return JSONResponse({"status": "ok", "running": worker.engine.running, "waiting": len(worker.engine.waiting)})

    async def metrics(request: Request):
        return PlainTextResponse(worker.metrics_text())

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ])


def _build_engine(args: argparse.Namespace, group) -> tuple[SpecEngine, Codec]:
    """This rank's engine over ``--model`` (and ``--draft``), and the model's codec.  Every
    rank builds the same codec, so every engine stops on the same EOS ids."""
    import dcp_compile as dcp
    from dcp_compile import loading

    spec = loading.resolve(args.model, args.draft)
    codec = loading.codec(spec)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if group.device.type == "cuda" else torch.float32)
    target, draft = loading.load(spec, max_batch=args.max_batch, max_seq_len=args.max_seq_len, device=group.device,
                                 dtype=dtype)
    lowering = args.lowering or ("inductor" if group.device.type == "cuda" else "aot_eager")
    decoder = dcp.SpecDecoder(target, draft, group, k=args.k if draft is not None else 0, max_batch=args.max_batch,
                              max_seq_len=args.max_seq_len, temperature=args.temperature, seed=args.seed,
                              lowering=lowering, chunk_size=min(args.chunk_size, args.max_seq_len),
                              cuda_graphs=args.cuda_graphs and group.device.type == "cuda")
    return SpecEngine(decoder, leader=True, stop_ids=codec.eos_ids), codec


def _warm_up(engine: SpecEngine, codec: Codec) -> None:
    """Compile (and capture) every step graph before the first client waits for it.
    Rank 0 here and the followers in ``follow`` run this one request without the EOS
    ids, so that an early EOS cannot leave a graph to the first client."""
    stop_ids, engine.stop_ids = engine.stop_ids, frozenset()
    engine.add_request(codec.encode("def main():\n"), SamplingParams(max_new_tokens=2 * engine.k + 2))
    while engine.has_work():
        engine.step()
    engine.stop_ids = stop_ids


def _join(args: argparse.Namespace):
    import dcp_compile as dcp

    device = args.device if args.device != "cuda" else None
    # Compiling ranks can drift apart by minutes; --collective-timeout applies to the
    # step plans once the warm-up is done, and --step-timeout to everything else.
    return dcp.init_group(device, timeout=timedelta(seconds=max(600.0, args.collective_timeout)))


def _follower(rank: int, size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    follow(args)


def follow(args: argparse.Namespace) -> None:
    """A rank other than 0: run rank 0's steps until it shuts the engine down.  Rank 0
    alone answers signals (a terminal's Ctrl-C or a SIGTERM reaches the whole process
    group): it drains and then stops the followers."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine, _ = _build_engine(args, _join(args))
    stop_ids, engine.stop_ids = engine.stop_ids, frozenset()
    try:
        # The first request is rank 0's warm-up (run without the EOS ids, as _warm_up
        # does); past it, a silent rank 0 is a failure.
        while not engine.stopped:
            engine.step()
            if engine.plan_timeout is None and engine.stats["finished"]:
                engine.plan_timeout = args.collective_timeout
                engine.stop_ids = stop_ids
    except BaseException as error:
        print(f"dcp-compile serve: rank {engine.group.rank} stopped: {type(error).__name__}: {error}", file=sys.stderr,
              flush=True)
        os._exit(1)
    # Skip the process-group teardown: a peer that already left can make it wait.
    os._exit(0)


def serve(args: argparse.Namespace) -> int:
    """Rank 0 (spawning the other ranks itself when not under torchrun)."""
    import torch.multiprocessing as mp
    import uvicorn

    from dcp_compile.runtime.launch import free_port

    followers = []
    if "RANK" not in os.environ:
        if args.device == "cuda" and torch.cuda.device_count() < args.dcp:
            raise SystemExit(f"--dcp {args.dcp} on cuda needs {args.dcp} GPUs, found {torch.cuda.device_count()}")
        port = free_port()
        if args.dcp > 1:
            ctx = mp.get_context("spawn")
            followers = [ctx.Process(target=_follower, args=(r, args.dcp, port, args), daemon=True)
                         for r in range(1, args.dcp)]
            for p in followers:
                p.start()
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(args.dcp), LOCAL_WORLD_SIZE=str(args.dcp),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.dcp))
    elif int(os.environ["RANK"]) != 0:
        follow(args)
        return 0
    group = _join(args)
    engine, codec = _build_engine(args, group)
    print(f"dcp-compile serve: {args.model!r}" + (f" with draft {args.draft!r}" if args.draft else "")
          + f", DCP group of {group.size} on {group.device.type}, max_batch {args.max_batch}, max_seq_len "
          f"{args.max_seq_len}, k={engine.k}, EOS ids {sorted(codec.eos_ids)}; compiling", file=sys.stderr, flush=True)
    _warm_up(engine, codec)
    engine.plan_timeout = args.collective_timeout
    worker = EngineThread(engine, step_timeout=args.step_timeout, admission_window=args.admission_window_ms / 1000)
    config = uvicorn.Config(build_app(worker, codec, served_model_name(args)), host=args.host, port=args.port,
                            log_level="warning", timeout_graceful_shutdown=args.drain_seconds)
    server = uvicorn.Server(config)
    worker.on_failure = lambda: setattr(server, "should_exit", True)
    worker.start()
    # uvicorn answers SIGTERM/SIGINT by draining HTTP, then raises the signal again for
    # the handler it found: make that one a no-op, so the engine drains next.
    import signal

    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    print(f"dcp-compile serve: listening on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server.run()
    worker.close(args.drain_seconds)
    failed = worker.failure is not None
    for p in followers:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            failed = True
    print(f"dcp-compile serve: stopped{' after a failure' if failed else ''}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


def served_model_name(args: argparse.Namespace) -> str:
    """What ``/v1/models`` lists and responses name: ``--served-model-name``, else the last
    part of ``--model``."""
    return args.served_model_name or Path(args.model).name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dcp_compile.runtime.generate import DEFAULT_CHUNK_SIZE

    parser.add_argument("--model", default="tiny-code", help="shipped model name, a `dcp-compile train` directory, or "
                        "a Hugging Face causal-LM directory (its tokenizer and chat template come with it)")
    parser.add_argument("--draft", help="an EAGLE3 or EAGLE-1 draft checkpoint directory for a Hugging Face --model "
                        "(default: none, one token per step)")
    parser.add_argument("--served-model-name", help="the model name the API reports (default: --model's last part)")
    parser.add_argument("--dcp", type=int, default=2, help="DCP group size when spawning ranks (default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=8, help="rows decoded together (default 8)")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="cache positions per row (default 1024)")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per verify step (default 4)")
    parser.add_argument("--temperature", type=float, default=0.0, help="for requests that give none (default 0: greedy)")
    parser.add_argument("--seed", type=int, default=0, help="the shared sampling generator's seed")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--lowering", choices=("inductor", "aot_eager"), help="default: inductor on CUDA, aot_eager on CPU")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--drain-seconds", type=float, default=30.0, help="SIGTERM: how long running requests may finish")
    parser.add_argument("--collective-timeout", type=float, default=60.0, help="seconds a rank waits for the next step's plan before failing")
    parser.add_argument("--admission-window-ms", type=float, default=10.0,
                        help="an idle engine waits this long after a request arrives for more to share its first "
                             "prefill chunk (default 10; 0: admit at once)")
    parser.add_argument("--step-timeout", type=float, default=120.0, help="seconds before a stuck step ends the server")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("dcp", "max_batch", "max_seq_len", "k", "chunk_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    for name in ("drain_seconds", "collective_timeout", "step_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not 0 <= args.admission_window_ms <= 1000:
        parser.error(f"--admission-window-ms must be in [0, 1000], got {args.admission_window_ms}")
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        parser.error("`dcp-compile serve` needs the serve extra: pip install 'dcp-compile[serve]'")
