"""Where the engine's host time goes in a steady decode step: the shipped pair (or any model
``bench_serve.py`` takes), every row decoding, no arrivals.

    python3 benchmarks/exp_engine_host.py --device cuda --out $OUT/engine_host.json

Times each phase of ``SpecEngine.step`` with ``time.perf_counter`` around the engine's own
methods (a wrapper costs about a microsecond a call): the plan and row bookkeeping, the
launch (the step graph's input copies and replay, then the token copy and events), the
wait for the step before, and the reading of its tokens; beside the step's time on the
device (its events).  The host keeps the device busy when its busy time a step (all but
the wait) stays under the device's step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="tiny-code")
    parser.add_argument("--draft")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import dcp_compile as dcp
    from dcp_compile.commands import loading
    from dcp_compile.runtime.engine import SamplingParams, SpecEngine

    device = torch.device(args.device)
    spec = loading.resolve(args.model, args.draft)
    target, draft = loading.load(spec, max_batch=args.max_batch, max_seq_len=args.max_seq_len, device=device,
                                 dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    decoder = dcp.SpecDecoder(target, draft, dcp.DCPGroup(1, 0, device, None), k=args.k, max_batch=args.max_batch,
                              max_seq_len=args.max_seq_len, cuda_graphs=device.type == "cuda",
                              lowering="inductor" if device.type == "cuda" else "aot_eager")
    engine = SpecEngine(decoder)
    budget = args.max_seq_len - 64
    for row in range(args.max_batch):
        engine.add_request([1 + row, 2, 3, 4], SamplingParams(max_new_tokens=budget))
    phases: dict[str, list[float]] = {}

    def timed(owner, name, phase):
        inner = getattr(owner, name)

        def wrapper(*a, **kw):
            started = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                phases.setdefault(phase, []).append(time.perf_counter() - started)
        setattr(owner, name, wrapper)

    for _ in range(20):  # prefill, compile, capture, settle
        engine.step()
    timed(engine, "_launch", "launch (all)")
    timed(engine.device_step, "step", "launch: input copies + replay")
    timed(engine, "_collect", "read the step before (all)")
    timed(torch.cuda.Event, "synchronize", "read: wait for the device")
    totals = []
    before = dict(engine.stats)
    for _ in range(args.steps):
        if not engine.has_work():
            break
        started = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - started)
    spent = {key: engine.stats[key] - before[key] for key in ("device_step_seconds", "device_wait_seconds",
                                                               "verify_steps")}
    device_ms = spent["device_step_seconds"] / max(1, spent["verify_steps"]) * 1e3
    median_us = {name: statistics.median(values) * 1e6 for name, values in phases.items()}
    median_us["step (all)"] = statistics.median(totals) * 1e6
    waits = phases.get("read: wait for the device", [0.0])
    busy = [t - w for t, w in zip(totals, waits)]
    median_us["host busy a step (all but the wait)"] = statistics.median(busy) * 1e6
    result = dict(steps=len(totals), device_step_ms_mean=device_ms, host_us_median=median_us,
                  device_idle_share=spent["device_wait_seconds"] / max(1e-12, spent["device_step_seconds"]
                                                                       + spent["device_wait_seconds"]),
                  gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, command="python3 " + " ".join(sys.argv))
    for name, us in median_us.items():
        print(f"{name:45s} {us:9.1f} us (median)")
    print(f"device step (mean over the timed steps)        {device_ms * 1e3:9.1f} us; idle share "
          f"{result['device_idle_share']:.4f}")
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
