"""The one thread that drives the engine on rank 0 of ``dcp-compile serve``.

HTTP handlers hand it requests and aborts through a queue (``submit``, ``cancel``); it
admits them, steps the engine, turns tokens into text (holding back what could start a
stop string) and hands each request's text back to its asyncio queue, one event-loop
wake-up per step.  A failed step fails every open request; a step that runs past
``step_timeout`` ends the process.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from types import MappingProxyType

from dcp_compile.runtime.engine import SpecEngine
from dcp_compile.serve_requests import Completion

_FINISH_REASONS = MappingProxyType({"eos": "stop", "length": "length"})
HEARTBEAT_SECONDS = 0.5
"""An idle leader still steps (one small broadcast) this often, so the followers' waits
stay far inside the collective timeout."""


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
            # The device's time in steps, and its idle time between steps launched back to
            # back: the host's share of the critical path (SpecEngine.stats).
            "dcp_device_step_seconds_total": round(stats["device_step_seconds"], 6),
            "dcp_device_wait_seconds_total": round(stats["device_wait_seconds"], 6),
            # Steady state: arrivals and departures must leave these two unchanged.
            "dcp_compiles_total": counters["stats"].get("unique_graphs", 0),
            "dcp_graph_captures_total": sum(r.captures for r in self.engine.decoder.graph_runners),
        }
        return "".join(f"{name} {value}\n" for name, value in lines.items())
