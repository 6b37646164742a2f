"""What Inductor's deterministic mode costs on one GPU: the same decode step compiled
with and without it, timed side by side.

    python3 benchmarks/bench_deterministic.py --out $OUT/deterministic.json   # one H200, ~2 min
    python3 benchmarks/bench_deterministic.py --small                          # CPU: checks the script

DCP groups of more than one rank compile under ``torch._inductor.config.deterministic``
(``backend.rank_identical_kernels``): without it, ranks pick reduction configs by
timing them and their replicated compute sums in different orders.  A group of one
keeps the defaults.  This measures the difference on a Llama-3-8B-shaped target with
``--layers`` layers (the kernels of one layer repeat, so a few layers show the per-layer
cost without a 32-layer compile), one GPU, ``dcp.backend(group_of_one, cascade=True)``:
each mode compiled once, its step captured in a CUDA graph, then ``--rounds`` rounds
that time both modes at every context in turn (median of ``--reps`` replays each).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

import dcp_compile as dcp
from bench_e2e import build, step_timer, target_config
from _report import leave, parse_with_watchdog, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", default="0,8192,32768")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parse_with_watchdog(parser)
    contexts = [0, 48] if args.small else [int(c) for c in args.contexts.split(",")]
    cfg, device = target_config(args.small, args.layers)
    cfg = dataclasses.replace(cfg, max_batch=args.batch, max_seq_len=max(contexts) + 64)
    group = dcp.DCPGroup(1, 0, device, None)
    model = build(cfg, group, device, args.seed)
    timers = {}
    for deterministic in (False, True):
        torch._dynamo.reset()  # a fresh compile for each mode
        timers[deterministic] = step_timer(model, group, device, args.batch, 1, args.reps, deterministic)
    rounds = {(mode, c): [] for mode in timers for c in contexts}
    for _ in range(args.rounds):
        for context in contexts:
            for mode, timed in timers.items():
                rounds[mode, context].append(timed(context))
    rows = []
    print(f"\n## decode step, {cfg.n_layers} layers, batch {args.batch}, one GPU: deterministic mode against the "
          f"defaults (median of {args.rounds} rounds x {args.reps} replays)")
    print("| context | defaults ms | deterministic ms | deterministic / defaults |")
    print("|---|---|---|---|")
    for context in contexts:
        default, fixed = (statistics.median(rounds[mode, context]) for mode in (False, True))
        rows.append(dict(context=context, default_ms=default * 1e3, deterministic_ms=fixed * 1e3,
                         ratio=fixed / default, rounds_ms={str(m): [r * 1e3 for r in rounds[m, context]]
                                                           for m in (False, True)}))
        print(f"| {context} | {default * 1e3:.3f} | {fixed * 1e3:.3f} | {fixed / default:.3f} |")
    summary = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   torch=torch.__version__, layers=cfg.n_layers, batch=args.batch, reps=args.reps,
                   rounds=args.rounds, command="python3 " + " ".join(sys.argv), rows=rows)
    report(summary, args.out)
    leave()


if __name__ == "__main__":
    main()
