"""The prefix kernel of a verify step against its width: the split-KV kernel, the flash
kernel and the one ``prefix_attention`` chooses (``triton_prefix.prefix_kernel``), over
batch x verify tokens at one context.

    python3 benchmarks/bench_verify_width.py --out $OUT/verify_width.json   # one H200, ~1 min
    python3 benchmarks/bench_verify_width.py --smoke --out /tmp/vw.json      # CPU, Triton interpreter

Shapes: Llama-3-8B heads (Hq=32, Hkv=8, D=128), bf16, every sequence using the whole
context.  Each timing is the median over ``--rounds`` interleaved rounds (the three arms
once a round) of the median over ``--reps`` replays of a CUDA graph, each graph calling
the arm on enough copies of K/V to read 512 MiB, so every call reads from HBM.  Steps of
more than 64 query rows per KV head also time ``split64``: the split-KV kernel holding 64
rows a program (its decode tile) instead of its 128 for wide steps.
Reported per point: ms per call of each arm, which kernel was chosen, the chosen
kernel over the faster of the two, and the chosen kernel at each width over the same
batch's 4-token verify (the cliff this choice removes: the flash kernel at batch 1 reads
each KV head's shard on one SM).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
COLD_BYTES = 512 * 2**20  # bytes one timed graph reads at least: ~8x the H200 L2


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--tokens", type=int, nargs="*", default=[4, 16, 24, 32, 48, 64, 128])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.ops.triton_interpret import patch_interpreter

        patch_interpreter()
        args.context, args.batches, args.tokens, args.reps, args.rounds = 96, [1, 2], [4, 24], 1, 1
    import torch

    from _report import Timer, timed_rounds
    from dcp_compile.ops.triton_flash import prefix_flash_triton
    from dcp_compile.ops.triton_prefix import prefix_attention_any_width, prefix_attention_triton, prefix_kernel, sm_count_of

    device = torch.device("cpu" if args.smoke else "cuda")
    hq, hkv, d = (8, 2, 64) if args.smoke else (32, 8, 128)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    timer = Timer(device, args.reps, warmup=0 if args.smoke else 3)
    scale = d ** -0.5
    points = []
    for batch in args.batches:
        kv_bytes = 2 * batch * hkv * args.context * d * torch.finfo(dtype).bits // 8
        copies = 1 if args.smoke else max(1, math.ceil(COLD_BYTES / kv_bytes))
        caches = [(torch.randn(batch, hkv, args.context, d, device=device, dtype=dtype),
                   torch.randn(batch, hkv, args.context, d, device=device, dtype=dtype)) for _ in range(copies)]
        kv_len = torch.full((batch,), args.context, device=device, dtype=torch.int64)
        for tokens in args.tokens:
            q = torch.randn(batch, hq, tokens, d, device=device, dtype=dtype)
            arms = {"split": prefix_attention_triton, "flash": prefix_flash_triton, "chosen": prefix_attention_any_width}
            if tokens * hq // hkv > 64:  # wide steps: the split-KV kernel's 128-row tiles against 64
                arms["split64"] = functools.partial(prefix_attention_triton, rows=64)
            prepared = {}
            for name, kernel in arms.items():
                calls = [lambda k=k, v=v, kernel=kernel: kernel(q, k, v, kv_len, scale) for k, v in caches]
                run, method = timer.prepare(calls)
                prepared[name] = (run, len(calls), method)
            ms = {name: round(1e3 * seconds, 4) for name, (seconds, _) in timed_rounds(prepared, timer, args.rounds).items()}
            choice = prefix_kernel(batch, hq, hkv, tokens, d, q.element_size(), sm_count_of(device))
            point = dict(batch=batch, tokens=tokens, **{f"{k}_ms": v for k, v in ms.items()}, choice=choice,
                         chosen_over_best=round(ms["chosen"] / min(ms["split"], ms["flash"]), 3))
            points.append(point)
            print(json.dumps(point), flush=True)
        del caches
    for point in points:
        base = next(p for p in points if p["batch"] == point["batch"] and p["tokens"] == min(args.tokens))
        point["chosen_over_narrowest"] = round(point["chosen_ms"] / base["chosen_ms"], 3)
    summary = dict(context=args.context, heads=[hq, hkv], head_dim=d, dtype=str(dtype), points=points,
                   gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                   command=" ".join(["python3", *sys.argv]))
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print("batch tokens  split_ms  split64 flash_ms chosen_ms choice  /best  /narrowest")
    for p in points:
        wide = f"{p['split64_ms']:8.4f}" if "split64_ms" in p else "       -"
        print(f"{p['batch']:5d} {p['tokens']:6d} {p['split_ms']:9.4f} {wide} {p['flash_ms']:8.4f} {p['chosen_ms']:9.4f} "
              f"{p['choice']:6s} {p['chosen_over_best']:6.3f} {p['chosen_over_narrowest']:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
