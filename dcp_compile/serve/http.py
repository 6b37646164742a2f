"""The HTTP side of ``dcp-compile serve`` (Starlette): the routes over a ``Frontend``, the
OpenAI response and stream-chunk shapes, and ``run_http``, the HTTP process's body.
Starlette is the serve extra's: only ``serve.serve`` imports this module, once
``serve.check_arguments`` has found it.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from dcp_compile.serve.frontend import STATUS_TIMEOUT_SECONDS, Frontend
from dcp_compile.serve.requests import Completion, parse_chat, parse_completion
from dcp_compile.text import Codec


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


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    error = {"message": message, "type": kind} | ({"code": code} if code else {})
    return JSONResponse({"error": error}, status_code=status)


def _unavailable(worker: Frontend) -> JSONResponse | None:
    """The 503 of a server whose engine failed or that is shutting down; None otherwise."""
    if worker.failure:
        return _error(503, f"the engine failed: {worker.failure}", "server_error")
    if worker.draining or worker.closed.is_set():
        return _error(503, "the server is shutting down", "server_error")
    return None


async def _run(worker: Frontend, request: Request, parse, model_name: str):
    """One completion request: parsed and checked (400; 404 for a model this server does
    not serve), handed to the engine, and answered whole or as a stream."""
    unavailable = _unavailable(worker)
    if unavailable is not None:
        return unavailable
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        return _error(400, f"the body is not valid JSON: {bad}")
    requested = body.get("model") if isinstance(body, dict) else None
    if requested is not None and requested != model_name:
        return _error(404, f"The model {requested!r} does not exist: this server serves {model_name!r} (GET /v1/models)",
                      code="model_not_found")
    try:
        completion = parse(body)
        worker.check(completion)
    except ValueError as bad:
        return _error(400, str(bad))
    completion.loop, completion.events = asyncio.get_running_loop(), asyncio.Queue()
    worker.submit(completion)
    if completion.stream:
        return StreamingResponse(_stream(worker, completion), media_type="text/event-stream")
    text, reason = "", None
    try:
        while reason is None:
            kind, *rest = await completion.events.get()
            if kind == "error":
                return _error(503, rest[0], "server_error")
            text += rest[0]
            reason = rest[1]
    except asyncio.CancelledError:
        worker.cancel(completion)
        raise
    return JSONResponse(_response(completion, text, reason))


async def _stream(worker: Frontend, completion: Completion):
    """A request's server-sent events, as the frontend hands its text over; a client
    that goes away has its request aborted."""
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


def build_app(worker: Frontend, codec: Codec, model_name: str) -> Starlette:
    """The HTTP side: routes over ``worker``, prompts and texts through ``codec``, and
    ``model_name`` as the one model ``/v1/models`` lists."""
    started = int(time.time())

    async def completions(request: Request):
        return await _run(worker, request, lambda body: parse_completion(body, model_name, codec), model_name)

    async def chat_completions(request: Request):
        context = worker.limits.max_seq_len - worker.limits.k - 1
        return await _run(worker, request, lambda body: parse_chat(body, model_name, codec, context=context),
                          model_name)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": started, "owned_by": "dcp-compile"}]})

    async def health(request: Request):
        status = await worker.status()
        unavailable = _unavailable(worker)
        if unavailable is not None:
            return unavailable
        if status is None:
            return _error(503, f"the engine did not answer in {STATUS_TIMEOUT_SECONDS:.0f}s", "server_error")
        return JSONResponse({"status": "ok", "running": status["dcp_requests_running"],
                             "waiting": status["dcp_requests_waiting"]})

    async def metrics(request: Request):
        return PlainTextResponse(worker.metrics_text(await worker.status()))

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ])


def run_http(requests, events, limits, args, model_name: str) -> None:
    """The HTTP process: Starlette on uvicorn over a ``Frontend`` on the engine process's
    pipes, until the engine drains, fails or goes away.  Signals are the engine
    process's to act on (a terminal's Ctrl-C reaches both): it drains, and says so."""
    import signal
    import sys

    import uvicorn

    from dcp_compile.commands import loading

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    codec = loading.codec(loading.resolve(args.model, args.draft))
    frontend = Frontend(requests, events, limits)
    config = uvicorn.Config(build_app(frontend, codec, model_name), host=args.host, port=args.port,
                            log_level="warning", timeout_graceful_shutdown=args.drain_seconds)
    server = uvicorn.Server(config)
    frontend.on_stop = lambda: setattr(server, "should_exit", True)
    frontend.start()
    server.handle_exit = lambda *_: None  # uvicorn's own drain on a signal: the engine process drains
    print(f"dcp-compile serve: listening on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server.run()
    sys.exit(1 if frontend.failure else 0)
