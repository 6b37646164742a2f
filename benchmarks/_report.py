"""What every GPU script shares: a hang watchdog, the JSON report, leaving without NCCL teardown."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time


def watchdog(seconds: float) -> None:
    """Print every thread's stack if the script is still running after ``seconds``.

    A hung collective otherwise ends in the outer ``timeout`` with nothing to say where it
    hung.  Every rank prints and keeps running (the outer ``timeout`` ends them), so one
    rank's exit cannot get the others killed before they print."""
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=False)


def parse_with_watchdog(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser.parse_args()`` with a ``--watchdog SECONDS`` option, armed before returning."""
    parser.add_argument("--watchdog", type=float, default=0,
                        help="seconds; then print every thread's stack if still running (0: off)")
    args = parser.parse_args()
    watchdog(args.watchdog)
    return args


def parse_trace_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The options every one-GPU trace benchmark shares (``--seed``, ``--device``, ``--small``,
    ``--out``), then ``parse_with_watchdog``."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a 2-layer toy and a short trace (to check the script)")
    parser.add_argument("--out")
    return parse_with_watchdog(parser)


def report(summary: dict | None, path: str | None) -> None:
    """Rank 0 passes its summary (others None); then the process exits with status 0."""
    if summary is not None:
        print(json.dumps(summary), flush=True)
        if path:
            with open(path, "w") as f:
                json.dump(summary, f, indent=1)


def leave() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # NCCL teardown at exit has been seen to hang on the GPU machines


def randomize(model):
    """Random weights of an 8B model's scale on the model's own device (norms stay at one)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(std=0.02)
    return model


def random_llama(cfg, device):
    """``Llama(cfg)`` with random weights on ``device`` (bf16 on CUDA, fp32 on CPU), built
    there, its KV caches left on meta for ``dcp.prepare`` to allocate: rows of a pool's
    ``max_batch x max_seq_len`` would otherwise exist at full size first."""
    import torch

    from dcp_compile.models import Llama

    torch.manual_seed(0)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return randomize(Llama(cfg, dtype=dtype, device=device, cache_device="meta"))


def log(message: str) -> None:
    """A timestamped progress line on stderr (the JSON goes to stdout)."""
    import time

    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def median_ms(fn, reps: int, *, warmup: int = 0, cuda: bool = True) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones:
    CUDA events around each call on a GPU, the host clock otherwise."""
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


class Timer:
    """Median seconds per call of a list of calls (one per copy of the inputs, so that
    every call reads from HBM rather than from L2): CUDA graphs and events on a GPU."""

    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup

    def prepare(self, calls, graph: bool = True) -> tuple:
        """``(run, method)``: one launch of every call, as a captured CUDA graph where it can
        (``measure`` warms it up)."""
        import torch

        for call in calls:  # compiles, autotunes, allocates
            call()
        if self.device.type != "cuda":
            return (lambda: [c() for c in calls]), "perf_counter"
        torch.cuda.synchronize()
        if not graph:
            return (lambda: [c() for c in calls]), "eager"
        try:
            captured = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for call in calls:
                    call()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(captured):
                for call in calls:
                    call()
            return captured.replay, "cuda-graph"
        except Exception as exc:  # noqa: BLE001 - fall back to eager launches, say so
            torch.cuda.synchronize()
            return (lambda: [c() for c in calls]), f"eager ({type(exc).__name__})"

    def measure(self, run, calls: int) -> float:
        """Median seconds per call over ``reps`` timed runs of ``run`` (after ``warmup``)."""
        seconds = self._cpu_seconds if self.device.type != "cuda" else self._cuda_seconds
        for _ in range(self.warmup):
            run()
        return statistics.median(seconds(run) for _ in range(self.reps)) / calls

    @staticmethod
    def _cuda_seconds(run) -> float:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    @staticmethod
    def _cpu_seconds(run) -> float:
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0


def short_error(exc: Exception) -> str:
    """The exception's first line and, for wrapped compile errors, its innermost cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
    causes = [line for line in lines[1:] if "Error" in line and not line.startswith("Set TORCH")]
    return f"{type(exc).__name__}: " + " ... ".join([lines[0][:200]] + [c[:300] for c in causes[-1:]])


def copy_arms(timer: Timer, device, copy_bytes: int, cold_bytes: int) -> dict:
    """The HBM copy ceiling for ``copy_bytes`` a call: ``{"copy/<method>": (run, calls,
    method)}``, the copy as a captured graph and as eager launches (report the faster: on
    the H200 a graph of one memcpy of 0.5 to 4 GiB ran at ~2.7 TB/s where eager copies and
    graphs of several smaller copies ran at ~4.2 TB/s), over enough pairs that a run moves
    ``cold_bytes``."""
    import math

    import torch

    n_pairs = max(1, math.ceil(cold_bytes / copy_bytes)) if device.type == "cuda" else 1
    pairs = [(torch.empty(copy_bytes // 2, device=device, dtype=torch.bfloat16).normal_(),
              torch.empty(copy_bytes // 2, device=device, dtype=torch.bfloat16)) for _ in range(n_pairs)]
    calls = [lambda s=s, d=d: d.copy_(s) for s, d in pairs]
    arms = {}
    for graph in (True, False):
        run, method = timer.prepare(calls, graph=graph)
        arms[f"copy/{method}"] = (run, len(calls), method)
    return arms


def timed_rounds(prepared: dict, timer: Timer, rounds: int) -> dict:
    """``{name: (median seconds a call over the rounds, [seconds a call, each round])}``:
    every prepared ``(run, calls, method)`` once per round, so drift in the GPU's clocks
    over the run hits every arm alike."""
    samples = {name: [] for name in prepared}
    for _ in range(rounds):
        for name, (run, calls, _method) in prepared.items():
            samples[name].append(timer.measure(run, calls))
    return {name: (statistics.median(r), r) for name, r in samples.items()}


def kilo(n: int) -> str:
    """A context length as the tables print it: ``32K``, or the number."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def cell(arm: dict, key: str, fmt: str) -> str:
    """One table cell of an arm's result: the value, ``fail`` for an error, ``-`` if skipped."""
    if key in arm:
        return fmt.format(arm[key])
    return "fail" if "error" in arm and not arm["error"].startswith("skipped") else "-"

