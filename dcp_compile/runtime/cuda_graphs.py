"""CUDA-graph replay of compiled steps, the collectives inside.

``GraphRunner(fn)`` captures ``fn`` once per input signature (shapes, dtypes, devices)
and replays it after that: inputs are copied into the captured buffers, and the outputs
returned are the graph's own buffers, valid until the same graph replays again (a copy
per output per replay would cost more than some of the graphs; ``clone_outputs=True``
gives a caller that keeps outputs across replays its own copies).  The
compiled graphs' roles are fixed at compile time, so a captured target step holds its
all-gathers and a captured draft step holds none: replay cannot disagree with capture
about what is sharded.

A steady-state decode loop must neither recompile nor recapture: ``captures`` counts
captures, and the caller's counters (Dynamo's) count compiles; tests read both.

Requirements of the captured function: static shapes and no host synchronisation (the
backend's host-side position check is off for captured steps; ``SpecDecoder`` admits
only requests whose positions fit the cache).  All graphs share one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_Signature = tuple


def _signature(args) -> _Signature:
    return tuple(
        (tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else ("const", a) for a in args
    )


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list
    outputs: object


def capture(fn: Callable[[], object], *, pool=None, warmup: int = 1, generators=()) -> tuple:
    """``(graph, outputs)``: ``fn()`` captured in a CUDA graph, after ``warmup`` calls on a
    side stream (first calls compile, autotune and create communicators, which a capture
    allows none of).  ``generators``: the generators ``fn`` draws from, their states put
    back after the warm-up and registered with the graph, so that each replay draws what
    an uncaptured call would."""
    graph = torch.cuda.CUDAGraph()
    if generators and not hasattr(graph, "register_generator_state"):
        raise RuntimeError(
            f"torch {torch.__version__} cannot register a generator of its own with a CUDA graph "
            f"(CUDAGraph.register_generator_state), which a captured sampler needs; capture the calls around the "
            f"sampler instead (SpecDecoder(step_graph=False))")
    before = [g.get_state() for g in generators]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    for generator, state in zip(generators, before):
        generator.set_state(state)
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs


class GraphRunner:
    def __init__(self, fn: Callable, *, pool=None, warmup: int = 2, clone_outputs: bool = False):
        self.fn = fn
        self.clone_outputs = clone_outputs
        self.warmup = warmup
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.graphs: dict[_Signature, _Captured] = {}
        self.captures = 0
        self.replays = 0

    def _capture(self, args) -> _Captured:
        static_inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        graph, outputs = capture(lambda: self.fn(*static_inputs), pool=self.pool, warmup=self.warmup)
        self.captures += 1
        return _Captured(graph, static_inputs, outputs)

    def __call__(self, *args):
        key = _signature(args)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = self._capture(args)
        for static, arg in zip(captured.inputs, args):
            if isinstance(arg, torch.Tensor):
                static.copy_(arg)
        captured.graph.replay()
        self.replays += 1
        if not self.clone_outputs:
            return captured.outputs
        return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, captured.outputs)
