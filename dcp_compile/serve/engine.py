"""The loop that drives the engine on rank 0 of ``dcp-compile serve``.

It reads the HTTP process's messages from one pipe and writes its own to another
(``serve.frontend.Frontend`` is the other end), and does nothing else: no text, no stop
strings, no HTTP.  While the engine runs, both pipes are served from inside each step, once
the step is launched (``SpecEngine.step``'s ``while_running``): the host would wait for the
step before it there anyway, so the pipes never delay a launch.  Messages in:

- ``("add", id, prompt, params)``: a request, already checked against the engine's limits;
- ``("abort", id)``: free its row at the next step;
- ``("status", tag)``: answer with the engine's counters (``/health``, ``/metrics``);
- ``("drain", seconds)``: stop admitting; let running requests finish for ``seconds``.

Out, one list of messages a step: ``("tokens", id, tokens, finished_by, cached_tokens)``,
``("refused", id, message)``, ``("status", tag, counters)``, ``("draining",)``, and last
``("closed",)`` or ``("failed", message)``.  A failed step (a dead or hung peer) ends the
loop; a step that runs past ``step_timeout`` ends the process.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque

from dcp_compile.runtime.engine import SpecEngine
from dcp_compile.serve.frontend import Frontend

SLOW_SECONDS = 100e-6
"""A call of the loop's own past which ``/metrics`` counts it as slow (as the engine counts
the device's long waits)."""
HEARTBEAT_SECONDS = 0.5
"""An idle leader still steps (one small broadcast) this often, so the followers' waits
stay far inside the collective timeout."""


class EngineLoop:
    """Rank 0's engine, stepped from the thread that calls ``run``.  ``requests`` and
    ``events``: the read end of the HTTP process's pipe and the write end of this one's."""

    def __init__(self, engine: SpecEngine, requests, events, *, step_timeout: float, admission_window: float = 0.0):
        self.engine, self.requests, self.events = engine, requests, events
        self.step_timeout = step_timeout
        self.admission_window = admission_window
        """Seconds an idle engine waits, after a request arrives, for more to join its
        first prefill: every prefill chunk costs one ``[max_batch, chunk_size]`` step
        however many rows it fills, so a burst that refills a drained batch should
        share one."""
        self.by_id: dict[int, int] = {}
        """The HTTP process's request ids to the engine's."""
        self.by_engine_id: dict[int, int] = {}
        self.outbox: list[tuple] = []
        self.inbox: deque[tuple] = deque()
        """Messages read during a step, acted on before the next."""
        self.unsent: dict = {}
        """The last step's events, posted once the next step is launched."""
        self.timings = dict(while_running_seconds=0.0, while_running_slow=0, between_steps_seconds=0.0,
                            between_steps_slow=0)
        """The loop's own host time: inside steps (``_while_running``) and between two steps
        of a running engine, with the calls past ``SLOW_SECONDS`` counted."""
        self.drain_deadline: float | None = None
        self.front_gone = False
        self.failure: str | None = None
        self.step_started: float | None = None
        self.stopped = threading.Event()

    def drain(self, seconds: float) -> None:
        """Stop admitting; abort what still runs after ``seconds``.  Safe from a signal
        handler: the loop acts on it between two steps."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + seconds
            self.outbox.append(("draining",))

    def run(self) -> str | None:
        """Step until drained, or until a step fails; returns the failure, or None."""
        threading.Thread(target=self._watchdog, name="dcp-step-watchdog", daemon=True).start()
        try:
            while True:
                started = time.perf_counter()
                busy = self.engine.has_work()
                self._take()
                if busy:
                    self._count("between_steps", time.perf_counter() - started)
                deadline = self.drain_deadline
                if deadline is not None and (not self.engine.has_work() or time.monotonic() > deadline):
                    self._end_all()
                    self.outbox.append(("closed",))
                    self._flush()
                    return self.failure
                self._step()
                if not self.engine.has_work():  # no next step to send them from
                    self._post()
                    self._flush()
        except BaseException as error:  # a failed collective, a dead peer: nothing more can run
            self.failure = f"{type(error).__name__}: {error}"
            print(f"dcp-compile serve: the engine stopped: {self.failure}", file=sys.stderr, flush=True)
            self.outbox = [("failed", self.failure)]
            self._flush()
            return self.failure
        finally:
            self.stopped.set()

    def _end_all(self) -> None:
        """Abort what still runs, finish the engine's last steps, stop the followers."""
        self._post()  # the last step's tokens and ends first: a request it finished is not aborted
        for engine_id, request_id in list(self.by_engine_id.items()):
            self.engine.abort(engine_id)
            self.outbox.append(("tokens", request_id, [], "abort", None))
        self.by_id.clear()
        self.by_engine_id.clear()
        while self.engine.has_work():
            self._step()
        self.engine.shutdown()

    def _flush(self) -> None:
        if self.outbox and not self.front_gone:
            batch, self.outbox = self.outbox, []
            try:
                self.events.send(batch)
            except OSError:
                self._lose_front()

    def _lose_front(self) -> None:
        """The HTTP process has gone: nobody reads what runs, so end it all now."""
        self.front_gone = True
        self.outbox = []
        if self.drain_deadline is None:  # not asked to stop: the HTTP process failed
            self.failure = "the HTTP process ended"
            print(f"dcp-compile serve: {self.failure}; stopping the engine", file=sys.stderr, flush=True)
            self.drain_deadline = time.monotonic()

    def _receive(self) -> None:
        """Read what the HTTP process has sent, without acting on it (``_take`` does)."""
        while not self.front_gone and self.requests.poll(0):
            try:
                self.inbox.append(self.requests.recv())
            except (EOFError, OSError):
                self._lose_front()

    def _take(self) -> None:
        """Act on the messages received during the last step; an idle engine also waits on
        the pipe for more, and for an admission window."""
        idle = block = not self.engine.has_work()
        gather_until = None
        while not self.front_gone:
            if self.inbox:
                kind, *message = self.inbox.popleft()
            else:
                if not idle:  # a running engine reads its pipe during each step (_while_running)
                    return
                timeout = HEARTBEAT_SECONDS if block else 0.0
                if gather_until is not None and self.engine.free_rows > 0:
                    block, timeout = True, max(0.0, gather_until - time.monotonic())
                if not self.requests.poll(timeout):
                    return
                try:
                    kind, *message = self.requests.recv()
                except (EOFError, OSError):
                    self._lose_front()
                    return
            block = False
            if kind == "add" and idle and gather_until is None and self.admission_window > 0:
                gather_until = time.monotonic() + self.admission_window
            getattr(self, "_on_" + kind)(*message)

    def _on_add(self, request_id: int, prompt: list[int], params) -> None:
        if self.drain_deadline is not None:
            self.outbox.append(("refused", request_id, "the server is shutting down"))
            return
        try:
            engine_id = self.engine.add_request(prompt, params)
        except ValueError as refused:
            self.outbox.append(("refused", request_id, str(refused)))
            return
        self.by_id[request_id] = engine_id
        self.by_engine_id[engine_id] = request_id

    def _on_abort(self, request_id: int) -> None:
        engine_id = self.by_id.pop(request_id, None)
        if engine_id is not None:
            del self.by_engine_id[engine_id]
            self.engine.abort(engine_id)

    def _on_status(self, tag: int) -> None:
        self.outbox.append(("status", tag, self.status()))
        self._flush()

    def _on_drain(self, seconds: float) -> None:
        self.drain(seconds)

    def _step(self) -> None:
        self.step_started = time.monotonic()
        events = self.engine.step(while_running=self._while_running)
        self.step_started = None
        self.unsent = events

    def _while_running(self) -> None:
        """The loop's own work, done while the device runs the step just launched (the host
        would wait for the one before it anyway): send the last step's tokens, read the
        pipe.  Nothing here calls the engine."""
        started = time.perf_counter()
        self._post()
        self._flush()
        self._receive()
        self._count("while_running", time.perf_counter() - started)

    def _count(self, name: str, seconds: float) -> None:
        self.timings[name + "_seconds"] += seconds
        if seconds > SLOW_SECONDS:
            self.timings[name + "_slow"] += 1

    def _post(self) -> None:
        """Queue the last step's tokens for the HTTP process."""
        events, self.unsent = self.unsent, {}
        for engine_id, event in events.items():
            request_id = self.by_engine_id.get(engine_id)
            if request_id is None:
                continue
            self.outbox.append(("tokens", request_id, event.tokens, event.finished_by, event.cached_tokens))
            if event.finished_by is not None:
                del self.by_engine_id[engine_id], self.by_id[request_id]

    def _watchdog(self) -> None:
        while not self.stopped.is_set():
            started = self.step_started
            if started is not None and time.monotonic() - started > self.step_timeout:
                print(f"dcp-compile serve: a step ran longer than --step-timeout {self.step_timeout:.0f}s (a rank "
                      "hangs?); exiting", file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(0.5)

    def status(self) -> dict:
        """The engine's counters, as ``/metrics`` names them."""
        from torch._dynamo.utils import counters

        stats = self.engine.stats
        steps, row_steps = stats["verify_steps"], stats["row_steps"]
        return {
            "dcp_requests_running": self.engine.running,
            "dcp_requests_waiting": len(self.engine.waiting),
            "dcp_verify_steps_total": steps,
            "dcp_mean_accept_length": round(stats["accepted"] / row_steps + 1, 4) if row_steps else 0.0,
            "dcp_step_seconds_total": round(stats["step_seconds"], 6),
            # The device's time in steps, and its idle time between steps launched back to
            # back: the host's share of the critical path (SpecEngine.stats).
            "dcp_device_step_seconds_total": round(stats.get("device_step_seconds", 0.0), 6),
            "dcp_device_wait_seconds_total": round(stats.get("device_wait_seconds", 0.0), 6),
            "dcp_device_waits_total": stats.get("device_waits", 0),
            "dcp_device_long_waits_total": stats.get("device_long_waits", 0),
            "dcp_device_long_wait_seconds_total": round(stats.get("device_long_wait_seconds", 0.0), 6),
            **{f"dcp_loop_{name}_total": round(v, 6) if isinstance(v, float) else v
               for name, v in self.timings.items()},
            # Steady state: arrivals and departures must leave these two unchanged.
            "dcp_compiles_total": counters["stats"].get("unique_graphs", 0),
            "dcp_graph_captures_total": sum(r.captures for r in self.engine.decoder.graph_runners),
            **self._pool_status(),
        }

    def _pool_status(self) -> dict:
        """A paged target's pool: its size and the tokens its running requests hold."""
        pages = self.engine.pages
        if pages is None:
            return {}
        return {"dcp_kv_pool_capacity_tokens": pages.capacity_tokens, "dcp_kv_pool_used_tokens": pages.used_tokens,
                "dcp_prefix_cache_hit_tokens_total": self.engine.stats["prefix_hit_tokens"],
                "dcp_preemptions_total": self.engine.stats["preemptions"]}


def serve_in_thread(engine: SpecEngine, *, step_timeout: float, admission_window: float = 0.0) -> Frontend:
    """A ``Frontend`` over an ``EngineLoop`` that runs ``engine`` in a thread of this
    process, through the same pipes as between the server's two processes: the HTTP side
    in one process with an engine (a scripted one in tests).  ``Frontend.close`` ends it."""
    from multiprocessing import Pipe

    requests_in, requests_out = Pipe(duplex=False)
    events_in, events_out = Pipe(duplex=False)
    loop = EngineLoop(engine, requests_in, events_out, step_timeout=step_timeout, admission_window=admission_window)
    threading.Thread(target=loop.run, name="dcp-engine", daemon=True).start()
    return Frontend(requests_out, events_in, engine.limits)
