"""The HTTP process's side of ``dcp-compile serve``: requests out to the engine process,
token ids back, text to each request's asyncio queue.

The engine process only steps: it reads requests and aborts from one pipe and writes
each step's token ids to another (``serve.engine``).  Everything else a request costs
on the host, turning tokens into text, finding stop strings and the HTTP work, runs
here, in a process of its own, so none of it holds the engine's interpreter between
two steps.  A stop string is found one step after its tokens were made, so its row is
aborted one step late; the text is cut where the string starts all the same.

``Frontend`` holds two threads: one writes requests to the engine (a long prompt never
blocks the event loop on a full pipe), one reads the engine's messages, decodes text
and hands each step's pieces to the event loop in one wake-up.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from types import MappingProxyType

from dcp_compile.runtime.request import RequestLimits
from dcp_compile.serve.requests import Completion

_FINISH_REASONS = MappingProxyType({"eos": "stop", "length": "length"})
STATUS_TIMEOUT_SECONDS = 10.0
"""How long ``/health`` and ``/metrics`` wait for the engine to answer between steps."""


def _deliver(batch: list[tuple[Completion, tuple]]) -> None:
    for completion, item in batch:
        completion.events.put_nowait(item)


class Frontend:
    """The engine as the HTTP handlers see it, over the two pipes of an ``EngineLoop``.

    ``requests``: the write end of the pipe the engine loop reads; ``events``: the read
    end of the one it writes.  ``limits``: the engine's, so that a bad request gets its
    400 here without a round trip."""

    def __init__(self, requests, events, limits: RequestLimits):
        self.requests, self.events, self.limits = requests, events, limits
        self.open: dict[int, Completion] = {}
        self.failure: str | None = None
        self.draining = False
        self.closed = threading.Event()
        self.metrics = dict(requests=0, finished=0, tokens=0)
        self.last_status: dict = {}
        self.on_stop: Callable[[], None] = lambda: None
        """Called (from the reader thread) when the engine drains, fails or goes away:
        the HTTP server stops taking connections."""
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._outbox: queue.Queue = queue.Queue()
        self._waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._pending: list[tuple[Completion, tuple]] = []

    def start(self) -> None:
        threading.Thread(target=self._write, name="dcp-requests", daemon=True).start()
        threading.Thread(target=self._read, name="dcp-events", daemon=True).start()

    # ---- called from the event loop

    def check(self, completion: Completion) -> None:
        """``ValueError`` for a request the engine would refuse (the vocabulary, the cache's
        room, the temperature)."""
        self.limits.check(completion.prompt, completion.params)

    def submit(self, completion: Completion) -> None:
        with self._lock:
            completion.engine_id = next(self._ids)
            self.open[completion.engine_id] = completion
            self.metrics["requests"] += 1
        self._outbox.put(("add", completion.engine_id, completion.prompt, completion.params))

    def cancel(self, completion: Completion) -> None:
        with self._lock:
            if completion.done or self.open.pop(completion.engine_id, None) is None:
                return
            completion.done = True
        self._outbox.put(("abort", completion.engine_id))

    async def status(self) -> dict | None:
        """The engine's counters (``EngineLoop.status``) as of its next pause between steps,
        or None when it failed, has stopped or did not answer in ``STATUS_TIMEOUT_SECONDS``."""
        if self.failure or self.closed.is_set():
            return None
        tag = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiters[tag] = (asyncio.get_running_loop(), future)
        self._outbox.put(("status", tag))
        try:
            return await asyncio.wait_for(future, STATUS_TIMEOUT_SECONDS)
        except asyncio.TimeoutError:
            return None
        finally:
            self._waiters.pop(tag, None)

    def close(self, drain_seconds: float) -> None:
        """Drain the engine (running requests may finish for ``drain_seconds``) and wait
        until it has stopped: for an engine loop in this process, as tests run one."""
        self._outbox.put(("drain", drain_seconds))
        self.closed.wait(timeout=drain_seconds + STATUS_TIMEOUT_SECONDS)

    # ---- the writer thread

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self.requests.send(message)
            except OSError:  # the engine has gone; the reader says so to every request
                return

    # ---- the reader thread

    def _read(self) -> None:
        try:
            while not self.closed.is_set():
                for message in self.events.recv():
                    getattr(self, "_on_" + message[0])(*message[1:])
                self._flush()
        except (EOFError, OSError):
            if not self.closed.is_set():
                self._on_failed(self.failure or "the engine process ended")
        finally:
            self.closed.set()
            for loop, future in list(self._waiters.values()):
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))

    def _send(self, completion: Completion, item: tuple) -> None:
        self._pending.append((completion, item))

    def _flush(self) -> None:
        """Hand the step's items to the event loop in one wake-up, not one per request."""
        if self._pending:
            batch, self._pending = self._pending, []
            batch[0][0].loop.call_soon_threadsafe(_deliver, batch)

    def _on_tokens(self, engine_id: int, tokens: list[int], finished_by: str | None,
                   cached_tokens: int | None = None) -> None:
        completion = self.open.get(engine_id)
        if completion is None or completion.done:
            return
        if cached_tokens is not None:
            completion.cached_tokens = cached_tokens
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
                self._outbox.put(("abort", engine_id))
            self._finish(completion, "stop")
        elif finished_by:
            self._finish(completion, _FINISH_REASONS.get(finished_by, finished_by))
        else:
            # Hold back what could be the start of a stop string.
            safe = len(completion.text) - max((len(s) - 1 for s in completion.stop), default=0)
            if safe > completion.sent:
                self._send(completion, ("text", completion.text[completion.sent:safe], None))
                completion.sent = safe

    def _finish(self, completion: Completion, reason: str) -> None:
        with self._lock:
            completion.done = True
            self.open.pop(completion.engine_id, None)
        self.metrics["finished"] += 1
        self._send(completion, ("text", completion.text[completion.sent:], reason))
        completion.sent = len(completion.text)

    def _on_refused(self, engine_id: int, message: str) -> None:
        with self._lock:
            completion = self.open.pop(engine_id, None)
        if completion is not None:
            completion.done = True
            self._send(completion, ("error", message))

    def _on_status(self, tag: int, status: dict) -> None:
        self.last_status = status
        loop, future = self._waiters.get(tag, (None, None))
        if future is not None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(status))

    def _on_draining(self) -> None:
        self.draining = True
        self.on_stop()

    def _on_failed(self, failure: str) -> None:
        self.failure = failure
        with self._lock:
            failed, self.open = list(self.open.values()), {}
        for completion in failed:
            completion.done = True
            self._send(completion, ("error", f"the engine failed: {failure}"))
        self._flush()
        self.closed.set()
        self.on_stop()

    def _on_closed(self) -> None:
        self.closed.set()
        self.on_stop()

    def metrics_text(self, status: dict | None) -> str:
        """``/metrics``: this process's request counters and the engine's ``status`` (its
        last answer when it gave none)."""
        status = status or self.last_status
        lines = {"dcp_requests_total": self.metrics["requests"],
                 "dcp_requests_finished_total": self.metrics["finished"],
                 "dcp_tokens_total": self.metrics["tokens"]}
        lines.update(status)
        return "".join(f"{name} {value}\n" for name, value in lines.items())
