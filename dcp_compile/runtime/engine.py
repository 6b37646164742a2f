"""Continuous batching over a ``SpecDecoder``: requests join and leave a running batch.

``SpecEngine.add_request`` queues a request, ``step`` admits queued requests into free
rows, feeds every row still prefilling its next prompt chunk (``prefill_chunks_per_step``,
so a long prompt holds the running rows up one chunk a step, not its whole length) and
runs one speculative step for every row whose prompt is in; ``abort`` frees a row at the
next step.  Shapes never change: a newcomer's prefill is the decoder's ``[max_batch,
chunk_size]`` chunk, a step is the decoder's step, so arrivals and departures neither
recompile nor recapture.  A paged target's rows hold pages of its pool (``row_pages``).

Every rank must take the same decisions.  Two ways to arrange it:

- every rank makes the same calls (``generate_all`` does: SPMD);
- ``leader=True``: rank 0 alone takes requests and aborts, and broadcasts each step's
  plan (``leader_plan``); the other ranks run ``follow()`` until rank 0 calls ``shutdown()``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from dcp_compile.runtime.generate import tokens_prefilled
from dcp_compile.runtime.leader_plan import Plan, broadcast_plan
from dcp_compile.runtime.request import RequestLimits, RequestOutput, SamplingParams, StepEvent, _Request, cut_at_stop
from dcp_compile.runtime.spec import SpecDecoder
from dcp_compile.runtime.row_pages import RowPages, reserve_tokens
from dcp_compile.runtime.state import STOP_IDS_PER_ROW, StepState, start_rows, stop_rows


@dataclass
class _InFlight:
    """A step launched whose tokens the host has not read yet."""

    rows: list[tuple[int, _Request]]
    """The rows it ran for, with the request each served then."""
    packed: torch.Tensor
    """``[B, width + 2]``: the emitted tokens, the accept count and whether the device
    keeps the row going; a pinned host copy on a GPU, filled when ``ready`` is."""
    ready: torch.cuda.Event | None
    began: torch.cuda.Event | None = None
    """Recorded before the step was launched: with ``ready``, the step's time on the device."""
    follows: torch.cuda.Event | None = None
    """The step before's ``ready`` when nothing else was queued between the two: from it to
    ``began``, the device waited for the host."""


LONG_WAIT_SECONDS = 100e-6
"""A gap between two steps queued back to back past which the stats count it as a pause."""


def _check_options(decoder: SpecDecoder, prefill_chunks_per_step: int | None, stop_ids, preemption: bool) -> None:
    if preemption and decoder.paging is None:
        raise ValueError("preemption grows a paged target's rows a page at a time, but this decoder has no pool: "
                         "build it with page_size and kv_tokens, or leave preemption off")
    if prefill_chunks_per_step is not None and (not isinstance(prefill_chunks_per_step, int)
                                                or prefill_chunks_per_step < 1):
        raise ValueError(f"prefill_chunks_per_step must be an int >= 1 or None, got {prefill_chunks_per_step!r}")
    bad = [t for t in stop_ids if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < decoder.target.vocab_size]
    if bad:
        raise ValueError(f"stop_ids must be token ids in [0, {decoder.target.vocab_size}), got "
                         f"{sorted(bad, key=repr)[:5]!r}")


class SpecEngine:
    """A step-level speculative decoding engine over ``decoder``'s rows.

    ``leader``: rank 0 owns the queue and broadcasts each step's admissions and aborts
    (through ``torch.distributed``); the other ranks call ``follow()``.  Without it, every
    rank must make the same calls in the same order.
    """

    def __init__(self, decoder: SpecDecoder, *, leader: bool = False, prefill_chunks_per_step: int | None = 1,
                 stop_ids: frozenset[int] = frozenset(), prefix_caching: bool = True, preemption: bool = False):
        _check_options(decoder, prefill_chunks_per_step, stop_ids, preemption)
        self.preemption = preemption
        """Rows grow a page at a time, and the newest request is preempted when the pool runs out."""
        self._preempted: set[int] = set()  # this step's, not admitted again in it
        self.stop_ids = frozenset(stop_ids)
        """Token ids that end every request (as its own ``eos_id`` does), e.g. all of a
        model's EOS ids.  Every rank builds its engine with the same set, so they are
        not broadcast."""
        self.stop_width = max(STOP_IDS_PER_ROW, len(self.stop_ids) + 1)
        """Stop ids a row's state holds, fixed for the engine's life: a step captured for
        its states holds this width, whatever ``stop_ids`` is set to later."""
        self.prefill_chunks_per_step = prefill_chunks_per_step
        self.decoder = decoder
        self.group = decoder.group
        self.device = decoder.device
        self.device_step = decoder.device_step
        self.device_step.verify_steps = 0
        self.leader = leader and self.group.replica_size > 1
        self.is_leader = self.group.replica_rank == 0 or not self.leader
        # Leader mode's plans go host to host: in the device's group they would queue behind
        # the step in flight, and every rank's host would wait for it before the next launch.
        self.control = dist.new_group(backend="gloo") if self.leader else None
        self.B, self.k, self.max_seq_len = decoder.max_batch, decoder.k, decoder.max_seq_len
        self.pages = None if decoder.paging is None else RowPages(
            decoder.paging, self.B, self.max_seq_len, chunk_size=decoder.chunk_size, prefix_caching=prefix_caching,
            draft=decoder.draft)
        self.vocab = decoder.target.vocab_size
        # The decoder's own: its captured steps hold these generators.
        self.noise = decoder.noise
        self.noise.reset(decoder.seed)
        self.state: StepState | None = None
        self.rows: list[_Request | None] = [None] * self.B
        self.waiting: deque[_Request] = deque()
        self.aborted_waiting: list[_Request] = []
        self.pending_aborts: set[int] = set()
        self.requests: dict[int, _Request] = {}
        self.next_id = 0
        self.stopped = False
        self.plan_timeout: float | None = None
        """Leader mode: seconds a rank waits for a step's plan (and an idle step's round
        trip) before the step fails; ``None``: the process group's timeout.  A server sets
        it once compilation is behind it, so that a rank that hangs is noticed soon."""
        self.stats = dict(admitted=0, finished=0, aborted=0, tokens=0, verify_steps=0, row_steps=0, accepted=0,
                          step_seconds=0.0, device_step_seconds=0.0, device_wait_seconds=0.0, device_waits=0,
                          device_long_waits=0, device_long_wait_seconds=0.0, prefix_hit_tokens=0, preemptions=0)
        """``step_seconds``: host time in ``step``.  On a GPU, ``device_step_seconds``: the
        steps' time on the device; ``device_wait_seconds``: time the device sat idle between
        two steps queued back to back (``device_waits`` such gaps), waiting for the host to
        launch the next: the host's share of the critical path; ``device_long_*``: those
        over ``LONG_WAIT_SECONDS`` (pauses), apart from the host's steady cost.  Gaps around a prefill,
        an admission or an abort are not counted.  A step's time starts when the host
        begins launching it, so when the device was idle by then, the launch counts as
        step time: the wait is a lower bound."""
        self.in_flight: _InFlight | None = None
        """The step launched last, whose tokens the next ``step`` reads (after launching its own)."""
        self._pinned: list[torch.Tensor] = []
        self._launches = 0
        self._last_ready: torch.cuda.Event | None = None

    # ---- requests (rank 0 in leader mode; every rank otherwise)

    @property
    def limits(self) -> RequestLimits:
        """What every request is checked against, as plain data (``dcp-compile serve``'s
        HTTP process checks requests with it, away from the engine)."""
        return RequestLimits(vocab=self.vocab, max_seq_len=self.max_seq_len, k=self.k,
                             temperature=self.decoder.temperature,
                             pool_tokens=self.pages.capacity_tokens if self.pages else 0)

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> tuple[list[int], float]:
        """The prompt as a list and the request's temperature, or ``ValueError`` saying what
        is wrong with them."""
        return self.limits.check(prompt, params)

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id.  Raises ``ValueError`` for a request the
        engine cannot serve, leaving the engine as it was."""
        if not self.is_leader:
            raise RuntimeError("in leader mode only rank 0 takes requests; the other ranks run follow()")
        params = params or SamplingParams()
        tokens, temperature = self.check_request(prompt, params)
        request = _Request(self.next_id, tokens, params, temperature)
        self.next_id += 1
        self.requests[request.id] = request
        self.waiting.append(request)
        return request.id

    def abort(self, request_id: int) -> bool:
        """End a request at the next step (its row is freed there); False if it is not
        queued or running."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.row is None:
            self.waiting.remove(request)
            self.aborted_waiting.append(request)
        else:
            self.pending_aborts.add(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.aborted_waiting or any(r is not None for r in self.rows))

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def free_rows(self) -> int:
        """Rows that no running or queued request will take."""
        return self.B - self.running - len(self.waiting)

    # ---- the step

    def _plan(self) -> Plan:
        plan = Plan(aborts=sorted(self.requests[i].row for i in self.pending_aborts))
        self.pending_aborts.clear()
        free = [row for row in range(self.B) if self.rows[row] is None or row in plan.aborts]
        budget = self.pages.available if self.pages else 0  # pages; the aborted rows' come back next step
        while self.waiting and free and self.waiting[0].id not in self._preempted:
            if self.pages:  # a paged target admits by the pages a request needs, in order
                budget -= self.pages.pages_for(reserve_tokens(self.waiting[0], self.k, self.preemption))
                if budget < 0:
                    break
            request = self.waiting.popleft()
            request.row = free.pop(0)
            plan.admits.append(request)
        return plan

    def _broadcast(self, plan: Plan | None) -> Plan:
        plan = broadcast_plan(plan, self.B, self.control, self._wait)
        if not self.is_leader:
            self.requests.update((request.id, request) for request in plan.admits)
        return plan

    def _wait(self, work) -> None:
        if self.plan_timeout is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=self.plan_timeout))

    def _emit(self, request: _Request, fresh: list[int], event: StepEvent) -> None:
        fresh = fresh[: request.params.max_new_tokens - len(request.tokens)]
        stops = self.stop_ids if request.params.eos_id is None else self.stop_ids | {request.params.eos_id}
        fresh, ended = cut_at_stop(fresh, stops)
        if ended:
            event.finished_by = "eos"
        request.tokens += fresh
        event.tokens += fresh
        self.stats["tokens"] += len(fresh)
        if not event.finished_by and len(request.tokens) >= request.params.max_new_tokens:
            event.finished_by = "length"

    def _free(self, request: _Request) -> None:
        if request.row is not None:
            if self.pages:
                self.pages.release(request.row)
            self.rows[request.row] = None
            self.noise.seed_row(request.row, None)
        self.requests.pop(request.id, None)

    def _grow(self) -> None:
        """Pages for every running request's next step, oldest first; while the pool lacks
        them, the newest running request is preempted."""
        for request in sorted(filter(None, self.rows), key=lambda r: self.pages.admitted_at(r.row)):
            while request.row is not None and not self.pages.grow(request.row, reserve_tokens(request, self.k, True)):
                self._preempt(self.rows[self.pages.newest([r.row for r in self.rows if r is not None])])

    def _preempt(self, request: _Request) -> None:
        """Free ``request``'s row and pages and queue it first, to be computed again from its
        prompt and the tokens it has emitted (the step in flight's are dropped: the
        recomputation gives them again)."""
        self.stats["preemptions"] += 1
        row, request.row = request.row, None
        stop_rows(self.state, [row])
        self.pages.release(row)
        self.rows[row] = None
        self.noise.seed_row(row, None)
        if request.id in self.pending_aborts:  # its client left: it ends at this step
            self.pending_aborts.discard(request.id)
            self.aborted_waiting.append(request)
            return
        request.prompt, request.fed, request.resumed = request.prompt + request.tokens, 0, True
        request.params = replace(request.params, max_new_tokens=request.params.max_new_tokens - len(request.tokens))
        request.tokens = []
        self._preempted.add(request.id)
        if self.is_leader:
            self.waiting.appendleft(request)
        else:
            self.requests.pop(request.id, None)

    def _live(self) -> list[bool]:
        """Rows decoding (their prompt all prefilled)."""
        return [r is not None and r.decoding for r in self.rows]

    def _agree_plan(self) -> Plan:
        """This step's plan, the same on every rank.  With preemption the rows grow first:
        the leader's before it plans, the others' from the same state once they have its plan."""
        self._preempted.clear()
        if self.preemption and self.is_leader:
            self._grow()
        plan = self._broadcast(self._plan() if self.is_leader else None) if self.leader else self._plan()
        if self.preemption and not self.is_leader:
            self._grow()
        return plan

    @torch.no_grad()
    def step(self, while_running: Callable[[], None] | None = None) -> dict[int, StepEvent]:
        """Apply this step's aborts and admissions, then run one speculative step for the
        running rows.  Returns each touched request's new tokens and end.

        ``while_running``: host work of the caller's (a server sends the last step's
        tokens) called once the step is launched, before the host waits for the step
        before it: there it overlaps the device's work instead of delaying the next
        launch.  It must not call the engine."""
        start = time.perf_counter()
        plan = self._agree_plan()
        events: dict[int, StepEvent] = {}
        if plan.stop:
            self.stopped = True
            return events
        if self.leader and not plan.admits and not plan.aborts and not any(self._live()):
            # An idle step is a round trip, so a rank that hangs fails it within the
            # group's timeout (a broadcast alone can complete into a socket buffer).
            self._wait(dist.all_reduce(torch.ones(1), group=self.control, async_op=True))
        for request in self.aborted_waiting:
            events[request.id] = StepEvent(finished_by="aborted")
            self.requests.pop(request.id, None)
        self.aborted_waiting = []
        for row in plan.aborts:
            request = self.rows[row]
            events[request.id] = StepEvent(finished_by="aborted")
            self.stats["aborted"] += 1
            self._free(request)
        if plan.aborts and self.state is not None:
            stop_rows(self.state, plan.aborts)
        for request in plan.admits:
            if self.pages:
                request.cached_tokens = request.fed = self.pages.admit(
                    request.row, request.prompt, reserve_tokens(request, self.k, self.preemption))
                self.stats["prefix_hit_tokens"] += request.cached_tokens
            self.rows[request.row] = request
            self.noise.seed_row(request.row, request.params.seed)
        self.stats["admitted"] += len(plan.admits)
        if any(r is not None and not r.decoding for r in self.rows):
            self._prefill(events)
        if plan.admits or plan.aborts or events:
            self._last_ready = None  # other work was queued since the last step
        # The step is launched before the last one's tokens are read, so that the host's
        # reading and bookkeeping overlap the device's work (``runtime.state``).
        launched = self._launch() if any(self._live()) else None
        if launched is None:
            self._last_ready = None
        if while_running is not None:
            while_running()
        if self.in_flight is not None:
            self._collect(self.in_flight, events)
        self.in_flight = launched
        self.stats["step_seconds"] += time.perf_counter() - start
        return events

    def _prefill(self, events: dict[int, StepEvent]) -> None:
        """The next chunk(s) of every row still prefilling; the running rows wait only
        that long.  A row whose prompt ends takes its first token and decodes from the
        next step."""
        prompts: list[Sequence[int]] = [[0]] * self.B
        admitted, temperature, starts = [False] * self.B, [0.0] * self.B, [0] * self.B
        filling = [r for r in self.rows if r is not None and not r.decoding]
        for request in filling:
            prompts[request.row], admitted[request.row] = request.prompt[request.fed:], True
            temperature[request.row], starts[request.row] = request.temperature, request.fed
        self.state = self.device_step.prefill(prompts, admitted, temperature, self.noise, self.state, starts=starts,
                                              max_chunks=self.prefill_chunks_per_step,
                                              stop_width=self.stop_width)
        done = []
        for request in filling:
            request.fed += tokens_prefilled(len(request.prompt) - request.fed, self.decoder.chunk_size,
                                            self.prefill_chunks_per_step)
            if request.decoding:
                done.append(request)
                if self.pages:
                    self.pages.prefilled(request.row, request.prompt)
        if not done:
            return
        first = self.state.current.tolist()
        started = []
        for request in done:
            event = events.setdefault(request.id, StepEvent())
            if not request.resumed:
                event.cached_tokens = request.cached_tokens
            self._emit(request, [first[request.row]], event)
            if event.finished_by:
                self._finish(request)
            else:
                started.append(request)
        start_rows(self.state, [r.row for r in started],
                   [r.params.max_new_tokens - len(r.tokens) for r in started], [self._stops(r) for r in started])

    def _stops(self, request: _Request) -> list[int]:
        eos = request.params.eos_id
        return sorted(self.stop_ids if eos is None else self.stop_ids | {eos})

    def _finish(self, request: _Request) -> None:
        self.stats["finished"] += 1
        self._free(request)

    def _launch(self) -> _InFlight:
        """Run one speculative step for the rows decoding, and queue the copy of its tokens
        to the host (read by ``_collect`` during the next step)."""
        state, live = self.state, self._live()
        state.sampling = any(on and r.temperature > 0 for on, r in zip(live, self.rows))
        began = None
        if self.device.type == "cuda":
            began = torch.cuda.Event(enable_timing=True)
            began.record()
        new_tokens, accepted, _ = self.device_step.step(state, self.noise)
        packed = torch.cat([new_tokens, accepted[:, None], state.active[:, None].long()], 1)
        ready = None
        if packed.is_cuda:
            if not self._pinned:  # two, in turn: one is read while the next is filled
                self._pinned = [torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True) for _ in range(2)]
            host = self._pinned[self._launches % 2]
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
            packed = host
        self._launches += 1
        self.stats["verify_steps"] += 1
        rows = [(row, request) for row, (request, on) in enumerate(zip(self.rows, live)) if on]
        flight = _InFlight(rows, packed, ready, began, self._last_ready)
        self._last_ready = ready
        return flight

    def _collect(self, flight: _InFlight, events: dict[int, StepEvent]) -> None:
        """Read a launched step's tokens (the one device-to-host copy of a step) and hand
        them to the rows' requests; a request aborted since the launch gets none."""
        if flight.ready is not None:
            flight.ready.synchronize()
            self.stats["device_step_seconds"] += flight.began.elapsed_time(flight.ready) / 1e3
            if flight.follows is not None:
                wait = flight.follows.elapsed_time(flight.began) / 1e3
                self.stats["device_wait_seconds"] += wait
                self.stats["device_waits"] += 1
                if wait > LONG_WAIT_SECONDS:
                    self.stats["device_long_waits"] += 1
                    self.stats["device_long_wait_seconds"] += wait
        host, width = flight.packed.tolist(), flight.packed.shape[1] - 2
        for row, request in flight.rows:
            if self.rows[row] is not request:
                continue
            a, going = host[row][width], host[row][width + 1]
            self.stats["accepted"] += a
            self.stats["row_steps"] += 1
            event = events.setdefault(request.id, StepEvent())
            event.accepted.append(a)
            self._emit(request, host[row][: a + 1], event)
            if (event.finished_by is None) != bool(going):
                raise RuntimeError(
                    f"request {request.id} in row {row}: the host {'ended it' if event.finished_by else 'keeps it'} "
                    f"after this step but the device {'keeps it going' if going else 'ended it'}; the two read "
                    f"the same tokens and budget, so this is a bug in dcp_compile.runtime.state")
            if event.finished_by:
                self._finish(request)

    # ---- leader mode

    def follow(self) -> None:
        """The other ranks' loop in leader mode: run rank 0's steps until it shuts down."""
        if self.is_leader:
            raise RuntimeError("follow() is for the ranks other than 0 in leader mode")
        while not self.stopped:
            self.step()

    def shutdown(self) -> None:
        """Rank 0 in leader mode: end the followers' loops (call with no request running)."""
        if self.leader and self.is_leader and not self.stopped:
            self._broadcast(Plan(stop=True))
        self.stopped = True


@torch.no_grad()
def generate_all(
    decoder: SpecDecoder,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    stop_ids: Sequence[int] = (),
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> list[RequestOutput]:
    """Decode every prompt with ``decoder``; ``on_tokens(request, new_tokens)`` streams as
    tokens are accepted.  ``eos_id`` and every id in ``stop_ids`` (a model's EOS ids) end a
    request.  Every rank must pass the same prompts.  A loop over a fresh ``SpecEngine``
    (its generator seeded with the decoder's ``seed``): more prompts than ``max_batch``
    queue, and start as earlier ones finish."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    engine = SpecEngine(decoder, stop_ids=frozenset(stop_ids))
    outputs = [RequestOutput() for _ in prompts]
    ids: dict[int, int] = {}
    for i, prompt in enumerate(prompts):
        try:
            ids[engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens, eos_id=eos_id))] = i
        except ValueError as error:
            outputs[i].finished_by, outputs[i].error = "refused", str(error)
    while engine.has_work():
        for request_id, event in engine.step().items():
            i = ids[request_id]
            outputs[i].tokens += event.tokens
            outputs[i].accepted += event.accepted
            if event.cached_tokens is not None:
                outputs[i].cached_tokens = event.cached_tokens
            if event.tokens and on_tokens is not None:
                on_tokens(i, event.tokens)
            if event.finished_by:
                outputs[i].finished_by = event.finished_by
    return outputs
