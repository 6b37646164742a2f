"""Per-layer cost of meeting the partials: collective + LSE merge, ag against a2a.

    timeout -k 10 300 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_merge.py --out $OUT/merge.json

Every arm is a chain of ``--layers`` layers compiled by Inductor and captured in one
CUDA graph (the collective inside); the figure is replay time / layers, median of
``--reps`` replays timed with CUDA events.  Each layer's payload is built from the
previous layer's merged output, so the layers run in order as in a model.

- ``ag``:  pack ``[out | lse]`` -> all-gather -> merge every head (what DCP inserts by default);
- ``a2a``: pack -> all-to-all by head group -> merge own heads -> all-gather merged heads;
- ``floor``: the raw NCCL all-gather of the same ``[out | lse]`` payload, nothing else.

Shapes: 32 query heads, D=128, T=1 (decode), batch 1..64, bf16 outputs, fp32 partials.
On CPU (``--device cpu``, gloo) it runs the same chains without CUDA graphs, to check
the script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from dcp_compile.ops.cascade import join_heads, merge_exchanged, merge_gathered, pack_partial, split_heads
from dcp_compile.passes.shard_attention import ALL_GATHER, ALL_TO_ALL, WAIT
from _report import leave, parse_with_watchdog, report


def make_chain(kind: str, size: int, rank: int, group_name: str, layers: int):
    def chain(x, lse, window_out, window_lse):
        # x: [B, H, 1, D] bf16, the previous layer's output
        for _ in range(layers):
            packed = pack_partial(x.float(), lse)
            if kind == "floor":
                gathered = WAIT(ALL_GATHER(packed, size, group_name))
                x = gathered[: x.shape[0], ..., :-1].to(x.dtype)
            elif kind == "ag":
                gathered = WAIT(ALL_GATHER(packed, size, group_name))
                x = merge_gathered(gathered, window_out, window_lse, size=size, dtype=x.dtype)
            else:
                splits = [1] * size
                exchanged = WAIT(ALL_TO_ALL(split_heads(packed, size=size), splits, splits, group_name))
                merged = merge_exchanged(exchanged, window_out, window_lse, size=size, rank=rank, dtype=x.dtype)
                x = join_heads(WAIT(ALL_GATHER(merged, size, group_name)), size=size)
        return x

    return chain


def time_arm(fn, args, device, reps: int) -> float:
    """Median seconds per call: CUDA graph replays with events on GPU, host clock on CPU."""
    for _ in range(3):
        fn(*args)
    if device.type != "cuda":
        samples = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            fn(*args)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out")
    args = parse_with_watchdog(parser)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    group_name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        H, D = args.heads, args.head_dim
        x = torch.randn(batch, H, 1, D, generator=gen).to(device, torch.bfloat16)
        lse = torch.randn(batch, H, 1, generator=gen).to(device)
        window_out = torch.randn(batch, H, 1, D, generator=gen).to(device)
        window_lse = torch.randn(batch, H, 1, generator=gen).to(device)
        row = dict(batch=batch, payload_bytes=batch * H * (D + 1) * 4)
        for kind in ("floor", "ag", "a2a"):
            if rank == 0:
                print(f"[{time.strftime('%H:%M:%S')}] batch {batch}: {kind}", file=sys.stderr, flush=True)
            try:
                chain = make_chain(kind, size, rank, group_name, args.layers)
                compiled = torch.compile(chain, backend="inductor" if device.type == "cuda" else "aot_eager", fullgraph=True)
                row[kind] = time_arm(compiled, (x, lse, window_out, window_lse), device, args.reps) / args.layers
            except Exception as err:  # one arm failing must not lose the others
                row[kind] = None
                row[f"{kind}_error"] = f"{type(err).__name__}: {err}"[:300]
                print(f"[rank {rank}] {kind} at batch {batch} failed: {row[f'{kind}_error']}", file=sys.stderr, flush=True)
        rows.append(row)
    if rank == 0:
        print(f"\n## per-layer collective + merge, DCP={size}, {args.layers} layers in one "
              f"{'CUDA graph' if device.type == 'cuda' else 'CPU call'}, median of {args.reps}")
        print("| batch | payload | floor (raw all-gather) | ag | ag / floor | a2a | a2a / floor |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            def us(v):
                return "failed" if v is None else f"{v * 1e6:.1f} us"

            def ratio(v):
                return "-" if v is None or r["floor"] is None else f"{v / r['floor']:.2f}"

            print(f"| {r['batch']} | {r['payload_bytes'] / 1024:.0f} KiB | {us(r['floor'])} | {us(r['ag'])} | "
                  f"{ratio(r['ag'])} | {us(r['a2a'])} | {ratio(r['a2a'])} |")
        summary = dict(dcp_size=size, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       torch=torch.__version__, layers=args.layers, reps=args.reps, rows=rows)
        report(summary, args.out)
    leave()


if __name__ == "__main__":
    main()
