"""The whole speculative step as one CUDA graph.

Captured one call at a time (``cuda_graphs.GraphRunner``), a step still runs its glue as
uncaptured kernels launched from the host between the graphs: the chain's proposals, a
tree's expansion and selection, the acceptance and the sampler, a dozen small kernels per
draft depth.  At batch 1 that host work costs as much as the verify itself (BENCHMARKS.md).
``StepGraph`` captures the step whole instead: the draft (chain or tree), the verify, the
acceptance (greedy and sampled), the commit and the draft's extend, over the compiled
graphs uncaptured (``SpecGraphs.compiled``), in one graph per value of the host's
``sampling`` flag (and whether any row is seeded).  A step is then a handful of input
copies, one replay and the caller's one read of the emitted tokens.

What the graph holds fixed, and who changes it:

- **Inputs** are static buffers: the state's tensors (``length``, ``current``, the
  draft's ``q_logits`` and ``hidden``, ``active``, ``temperature``, ``remaining``,
  ``stops``) are copied in before a replay when they are not those buffers already, so
  rows that join, finish or are aborted change inputs, never the graph.  What the step
  changes (the draft's next logits and hidden state, the rows moved on and ended:
  ``state.finish_and_advance``) it writes back into its own input buffers inside the
  graph, and the state points at them after the step: a step that follows a step copies
  nothing in, and the host may launch it before it reads the first one's tokens.
- **Random numbers** come from the batch's generator (``Noise.shared``) and, while any
  row is seeded, from every row's own generator (``Noise.row_generators``, reseeded in
  place for each request), all registered with the graph: each replay advances them as
  the uncaptured step would and draws the same numbers.  Which rows are seeded is a
  device mask the graph reads, so one graph serves every mix of seeded rows.
- **Outputs** (``new_tokens``, ``accepted``, ``bonus``) are the graph's own buffers, valid
  until the next replay; nothing is cloned.

Capture: two warm-up steps on a side stream (Inductor's first calls and the
communicators' set-up cannot be captured) with the generator's state put back after
them, so the captured step draws what an uncaptured one would.  The warm-ups run on
the graph's own buffers, which the first replay's input copies then overwrite; they
write KV slots at or past the rows' committed lengths, and no further than a live row's
budget lets a step write (``state.finish_and_advance`` ends a row before it could pass
its cache), and every step writes such a slot before anything reads it.

On a CPU group (``capture=False``) the same object runs the step over the same static
buffers without a graph: what the CPU tests check of the buffers and the write-back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from dcp_compile.runtime.cuda_graphs import capture
from dcp_compile.runtime.sampling import Noise

_STATE_INPUTS = ("length", "current", "q_logits", "hidden", "active", "temperature", "remaining", "stops")


class StepParts(NamedTuple):
    """The compiled calls one speculative step makes (``None``: not in this decoder)."""

    target_verify: Callable
    commit_c: Callable | None
    draft_step: Callable | None
    """The draft's extend and chain step (one compiled callable, a graph per width)."""
    draft_tree: list | None
    """A tree's draft depths after the first, one callable each."""


@dataclass
class _Step:
    """One captured (or, on CPU, prepared) step for one ``(sampling, seeded)`` pair."""

    inputs: dict[str, torch.Tensor | None]
    run: Callable[[], tuple]
    noise: Noise
    graph: object | None = None
    outputs: tuple | None = None


class StepGraph:
    """``step(state, noise)`` as one replay.  ``run_step(state, noise)`` is the step's
    work (``DeviceStep.run_step`` over the uncaptured parts); ``capture``: capture it in
    a CUDA graph (else run it over the static buffers); ``pool``: the CUDA graph memory
    pool it shares with the decoder's other graphs."""

    def __init__(self, run_step: Callable, *, capture: bool, pool=None, warmup: int = 2):
        self.run_step, self.capture, self.pool, self.warmup = run_step, capture, pool, warmup
        self.steps: dict[tuple[bool, bool], _Step] = {}
        self.captures = 0
        self.replays = 0

    def __call__(self, state, noise: Noise) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (state.sampling, state.sampling and bool(noise.rows))
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = self._prepare(state, noise)
        if noise is not step.noise:
            raise ValueError("StepGraph: this step was captured drawing from another Noise; a captured step holds its "
                             "generators, so pass the one it was captured with (SpecDecoder.noise) and reset it")
        _load(step.inputs, state)
        if step.graph is not None:
            step.graph.replay()
            outputs = step.outputs
        else:
            outputs = step.run()
        self.replays += 1
        for name, buffer in step.inputs.items():
            setattr(state, name, buffer)
        return outputs

    def _prepare(self, state, noise: Noise) -> _Step:
        inputs = {name: None if getattr(state, name) is None else getattr(state, name).clone()
                  for name in _STATE_INPUTS}
        sampling = state.sampling
        state = replace(state)  # the run's template: the caller's state object changes between steps

        def run() -> tuple:
            inner = replace(state, sampling=sampling, **inputs)
            outputs = self.run_step(inner, noise)
            for name, buffer in inputs.items():  # what the step changed, into its own input buffers
                value = getattr(inner, name)
                if value is not buffer:
                    buffer.copy_(value)
            return outputs

        step = _Step(inputs, run, noise)
        if self.capture:
            generators = [noise.shared] + (noise.row_generators if noise.rows else [])
            step.graph, step.outputs = capture(run, pool=self.pool, warmup=self.warmup, generators=generators)
            self.captures += 1
        return step


def _load(inputs: dict[str, torch.Tensor | None], state) -> None:
    """Copy the state into the static inputs (a tensor that already is its buffer, like
    the draft's logits the last replay wrote back, is left alone)."""
    for name, buffer in inputs.items():
        value = getattr(state, name)
        if (buffer is None) != (value is None):
            raise ValueError(f"StepGraph: the state's {name} is {'None' if value is None else 'a tensor'}, but the "
                             f"step was captured with {'none' if buffer is None else 'one'}")
        if buffer is not None and value is not buffer:
            if value.shape != buffer.shape:
                raise ValueError(f"StepGraph: the state's {name} has shape {tuple(value.shape)}, but the step was "
                                 f"captured with {tuple(buffer.shape)}; a step replays the shapes it was captured "
                                 f"with (for stops: every engine over one decoder holds the same number of stop ids)")
            buffer.copy_(value)
