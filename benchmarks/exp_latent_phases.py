"""Where the seesaw kernel's time goes (MLA's latent prefix, Hopper), one point at a time.

    python3 benchmarks/exp_latent_phases.py --out $OUT/phases.json    # one H200

For each point: every program's global-timer stamps (``seesaw_attention(times=...)``: its
start, q landed, loop done, partials stored), as medians over the programs of the last of
several back-to-back calls, with the spread of their ends; the kernel and the merge timed
apart by ``torch.profiler`` over CUDA-graph replays; and the op's time a call from a graph
of many calls; each form of the slices' partials (``--partials``) at every point.  The
stamps found the epilogue's bank conflicts (BENCHMARKS.md, 2026-12-04).
The global timer ticks in steps of about 0.26 us on the H200.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import statistics
import sys
from pathlib import Path

POINTS = ((8, 128, 1, 8192), (8, 16, 4, 32768), (8, 128, 1, 32768))
"""The two points under 400 TFLOP/s and one above (batch, heads, tokens, context)."""
CACHES = 4
"""Caches a point cycles through, so that consecutive calls do not find the last one's in L2."""


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="write the JSON results here")
    parser.add_argument("--replays", type=int, default=20, help="graph replays timed, 5 rounds of the caches each")
    parser.add_argument("--partials", nargs="+", default=["fp16", "fp32"],
                        help="forms of the slices' partials, each timed at every point, one after the other")
    parser.add_argument("--beside", nargs="*", default=[], metavar="FILE",
                        help="copies of gluon_latent.py (another form of the kernel) timed at every point beside "
                             "the library's, with the first of --partials")
    return parser.parse_args()


def stamps_of(times) -> dict:
    """Median phase lengths (us) over the programs, and the spread of their ends."""
    t = times.view(-1, 4).cpu().double()
    t0 = t[:, 0].min()
    ends = (t[:, 3] - t0) / 1e3
    return dict(q_landed=(t[:, 1] - t[:, 0]).median().item() / 1e3, loop=(t[:, 2] - t[:, 1]).median().item() / 1e3,
                store=(t[:, 3] - t[:, 2]).median().item() / 1e3, first_end=ends.min().item(),
                median_end=ends.median().item(), last_end=ends.max().item(),
                last_start=(t[:, 0].max() - t0).item() / 1e3)


def kernel_times(graph) -> dict:
    """Median device time (us) of each kernel over 10 replays of ``graph``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    spans = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type.name == "CUDA":
            spans[event.name[:32]].append(event.time_range.end - event.time_range.start)
    return {name: round(statistics.median(v), 2) for name, v in spans.items()}


def kernel_module(path: str | None):
    """The library's ``gluon_latent``, or a copy of it loaded from ``path``."""
    if path is None:
        from dcp_compile.ops import gluon_latent

        return gluon_latent
    spec = importlib.util.spec_from_file_location(f"beside_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def point(batch, heads, tokens, context, replays, partials, gluon_latent, source=None) -> dict:
    """One point under ``gluon_latent`` (the library's, or a copy loaded from ``source``)."""
    import torch

    from dcp_compile.ops.attention import latent_prefix_attention_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, tokens, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    caches = [(torch.randn(batch, 1, context, 512, device="cuda", dtype=torch.bfloat16, generator=gen),
               torch.randn(batch, 1, context, 64, device="cuda", dtype=torch.bfloat16, generator=gen))
              for _ in range(CACHES)]
    kv_len = torch.full((batch,), context, device="cuda")
    ref_out, ref_lse = latent_prefix_attention_reference(q.float(), caches[0][0].float(), caches[0][1].float(),
                                                         kv_len, 0.07)
    out, lse = gluon_latent.seesaw_attention(q, *caches[0], kv_len, 0.07, partials=partials)
    error = dict(out=(out - ref_out).abs().max().item(), lse=(lse - ref_lse).abs().max().item())
    row_blocks, splits, _ = gluon_latent.seesaw_grid(q, caches[0][0])
    times = torch.zeros(batch * row_blocks * splits, 4, dtype=torch.int64, device="cuda")
    for latent, rope in caches:
        gluon_latent.seesaw_attention(q, latent, rope, kv_len, 0.07, times=times, partials=partials)
    torch.cuda.synchronize()

    def calls():
        for latent, rope in caches:
            gluon_latent.seesaw_attention(q, latent, rope, kv_len, 0.07, partials=partials)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(5):
            calls()
    graph.replay()
    torch.cuda.synchronize()
    kernels = kernel_times(graph)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    per_call = start.elapsed_time(end) * 1e3 / (replays * 5 * CACHES)
    flop = batch * heads * tokens * context * 2.0 * (2 * 512 + 64)
    result = dict(batch=batch, heads=heads, t=tokens, context=context, splits=splits, partials=partials, source=source,
                  max_error=error, stamps_us=stamps_of(times), kernels_us=kernels, per_call_us=per_call,
                  tflops=flop / per_call / 1e6)
    form = f"{partials} partials" + (f", {source}" if source else "")
    print(f"B={batch} H={heads} T={tokens} S={context} ({splits} slices, {form}): "
          f"{ {k: round(v, 2) for k, v in result['stamps_us'].items()} }; kernels {kernels}; "
          f"{per_call:.2f} us a call ({result['tflops']:.0f} TFLOP/s); max error {error}", flush=True)
    return result


def main() -> int:
    args = parse_args()
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("the seesaw kernel runs on Hopper (compute capability 9.0)", file=sys.stderr)
        return 2
    library = kernel_module(None)
    forms = ([(partials, library, None) for partials in args.partials]
             + [(args.partials[0], kernel_module(path), path) for path in args.beside])
    results = [point(*p, args.replays, *form) for p in POINTS for form in forms]
    Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                              command="python3 " + " ".join(sys.argv), points=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
