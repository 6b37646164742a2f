"""Whether a compile inlines the attention ops' Triton kernels into Inductor's code.

Inlined (the default), Inductor sees the kernels themselves (``triton_prefix.py`` says
how): no Python dispatch between them, and their buffers planned with the rest; Inductor
analyses and compiles every launch site of every graph.  Opaque, each op is one call
that Inductor leaves alone and Triton compiles once per kernel at its first launch
(cached on disk across processes); inside a CUDA graph the call's Python dispatch is
paid at capture, not at replay.  ``benchmarks/bench_compile.py`` compares the two.

The choice is bound when a backend lowers a graph (``dcp.backend(..., kernels=...)``)
and read only while Inductor traces it: nothing reads it at run time.
"""

from __future__ import annotations

import contextlib
import contextvars

KERNELS = ("inline", "opaque")

_inlined = contextvars.ContextVar("dcp_compile_inline_kernels", default=True)


def kernels_inlined() -> bool:
    """Whether the graph being traced now inlines the Triton kernels."""
    return _inlined.get()


@contextlib.contextmanager
def lowering_kernels(kernels: str):
    """Trace the graphs lowered inside with the attention kernels ``"inline"`` or ``"opaque"``."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    token = _inlined.set(kernels == "inline")
    try:
        yield
    finally:
        _inlined.reset(token)
