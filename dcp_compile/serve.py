"""``dcp-compile serve``: an OpenAI-compatible completions server over a ``SpecEngine``.

Rank 0 serves HTTP (Starlette on uvicorn) and runs the engine in one thread of its own;
the other ranks run the engine's follower loop.  The engine thread is the only code that
touches the engine: HTTP handlers hand it requests and aborts through a queue, and it
hands tokens back to each request's asyncio queue.

The shipped models read and write bytes: a prompt is text (UTF-8) or a list of token
ids (bytes), and the completion is the bytes decoded as UTF-8.

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
import codecs
import json
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from dcp_compile.runtime.engine import SamplingParams, SpecEngine

SHIPPED_EOS = 0
"""The document separator the shipped byte-level models were trained with."""

_FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "seed", "stop", "stream", "n", "user"})
HEARTBEAT_SECONDS = 0.5
"""An idle leader still steps (one small broadcast) this often, so the followers' waits
stay far inside the collective timeout."""


class BadRequest(ValueError):
    """A request the server refuses with 400."""


@dataclass
class Completion:
    """One request as the HTTP side sees it."""

    prompt: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    model: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    engine_id: int | None = None
    # engine-thread side
    text: str = ""
    sent: int = 0
    tokens: int = 0
    done: bool = False
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


def _type_error(name: str, expected: str, value) -> BadRequest:
    return BadRequest(f"'{name}' must be {expected}, got {type(value).__name__} {value!r:.60}")


def parse_completion(body, model: str) -> Completion:
    """The request body as a ``Completion``, or ``BadRequest`` saying what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise BadRequest(f"unsupported fields {unknown}: this server implements {sorted(_FIELDS)}")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        tokens = list(prompt.encode("utf-8"))
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        tokens = prompt
    else:
        raise _type_error("prompt", "a string or a list of token ids", prompt)
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _type_error("max_tokens", "an integer", max_tokens)
    if max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be >= 1, got {max_tokens}")
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
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest(f"'n' must be 1 (one completion per request), got {n!r}")
    params = SamplingParams(max_new_tokens=max_tokens, temperature=None if temperature is None else float(temperature),
                            seed=seed, eos_id=SHIPPED_EOS)
    return Completion(tokens, params, stop, stream, str(body.get("model") or model))


def _deliver(batch: list[tuple[Completion, tuple]]) -> None:
    for completion, item in batch:
        completion.events.put_nowait(item)


class EngineThread:
    """The one thread that drives the engine on rank 0."""

    def __init__(self, engine: SpecEngine, *, step_timeout: float):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.by_engine_id: dict[int, Completion] = {}
        self.outbox: list[tuple[Completion, tuple]] = []
        self.failure: str | None = None
        self.draining = False
        self.closed = threading.Event()
        self.step_timeout = step_timeout
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
        if finished_by == "eos" and tokens and tokens[-1] == SHIPPED_EOS:
            tokens = tokens[:-1]
        completion.text += completion.decoder.decode(bytes(tokens), final=finished_by is not None)
        hits = [completion.text.find(s, max(0, completion.sent - len(s))) for s in completion.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            completion.text = completion.text[: min(hits)]
            if not finished_by:
                self.engine.abort(completion.engine_id)
            self._finish(completion, "stop")
        elif finished_by:
            self._finish(completion, "stop" if finished_by == "eos" else finished_by)
        else:
            # Hold back what could be the start of a stop string.
            safe = len(completion.text) - max((len(s) - 1 for s in completion.stop), default=0)
            if safe > completion.sent:
                self._send(completion, ("text", completion.text[completion.sent:safe], None))
                completion.sent = safe

    def _take(self, block: bool, deadline: float | None) -> float | None:
        while True:
            try:
                kind, value = self.inbox.get(block=block, timeout=HEARTBEAT_SECONDS if block else None)
            except queue.Empty:
                return deadline
            block = False
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


def build_app(worker: EngineThread, model_name: str):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)

    def chunk(completion: Completion, text: str, reason: str | None) -> dict:
        return {"id": completion.id, "object": "text_completion", "created": completion.created,
                "model": completion.model, "choices": [{"index": 0, "text": text, "finish_reason": reason}]}

    async def completions(request: Request):
        if worker.failure:
            return error(503, f"the engine failed: {worker.failure}", "server_error")
        if worker.draining:
            return error(503, "the server is shutting down", "server_error")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as bad:
            return error(400, f"the body is not valid JSON: {bad}")
        try:
            completion = parse_completion(body, model_name)
            worker.engine.check_request(completion.prompt, completion.params)
        except ValueError as bad:
            return error(400, str(bad))
        completion.loop, completion.events = asyncio.get_running_loop(), asyncio.Queue()
        worker.submit(completion)
        usage = lambda: {"prompt_tokens": len(completion.prompt), "completion_tokens": completion.tokens,  # noqa: E731
                         "total_tokens": len(completion.prompt) + completion.tokens}
        if completion.stream:
            async def events():
                finished = False
                try:
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
                            yield f"data: {json.dumps({'error': {'message': rest[0], 'type': 'server_error'}})}\n\n"
                            finished = True
                            return
                        text, reason = rest
                        if text or reason:
                            yield f"data: {json.dumps(chunk(completion, text, reason))}\n\n"
                        if reason:
                            finished = True
                            yield "data: [DONE]\n\n"
                            return
                finally:
                    if not finished:  # the client went away
                        worker.cancel(completion)

            return StreamingResponse(events(), media_type="text/event-stream")
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
        return JSONResponse(dict(chunk(completion, text, reason), usage=usage()))

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
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ])


def _build_engine(args: argparse.Namespace, group) -> SpecEngine:
    import dcp_compile as dcp
    from dcp_compile.models.pretrained import load_pair

    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if group.device.type == "cuda" else torch.float32)
    target, draft = load_pair(args.model, max_batch=args.max_batch, max_seq_len=args.max_seq_len, device=group.device,
                              dtype=dtype)
    lowering = args.lowering or ("inductor" if group.device.type == "cuda" else "aot_eager")
    decoder = dcp.SpecDecoder(target, draft, group, k=args.k, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                              temperature=args.temperature, seed=args.seed, lowering=lowering,
                              chunk_size=min(args.chunk_size, args.max_seq_len),
                              cuda_graphs=args.cuda_graphs and group.device.type == "cuda")
    return SpecEngine(decoder, leader=True)


def _warm_up(engine: SpecEngine) -> None:
    """Compile (and capture) every step graph before the first client waits for it."""
    engine.add_request(list(b"def main():\n"), SamplingParams(max_new_tokens=2 * engine.k + 2))
    while engine.has_work():
        engine.step()


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
    engine = _build_engine(args, _join(args))
    try:
        # The first request is rank 0's warm-up; past it, a silent rank 0 is a failure.
        while not engine.stopped:
            engine.step()
            if engine.plan_timeout is None and engine.stats["finished"]:
                engine.plan_timeout = args.collective_timeout
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
    engine = _build_engine(args, group)
    print(f"dcp-compile serve: {args.model!r}, DCP group of {group.size} on {group.device.type}, max_batch "
          f"{args.max_batch}, max_seq_len {args.max_seq_len}, k={args.k}; compiling", file=sys.stderr, flush=True)
    _warm_up(engine)
    engine.plan_timeout = args.collective_timeout
    worker = EngineThread(engine, step_timeout=args.step_timeout)
    config = uvicorn.Config(build_app(worker, args.model), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.drain_seconds)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dcp_compile.runtime.generate import DEFAULT_CHUNK_SIZE

    parser.add_argument("--model", default="tiny-code", help="shipped model name or a `dcp-compile train` directory")
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
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        parser.error("`dcp-compile serve` needs the serve extra: pip install 'dcp-compile[serve]'")
