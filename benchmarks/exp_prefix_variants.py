"""Tile and pipeline variants of the split-KV prefix kernel for wide verify steps, side
by side with an earlier version of the kernel, in interleaved rounds.

    python3 benchmarks/exp_prefix_variants.py --old old_prefix.py --out $OUT/variants.json   # one H200

``--old``: a copy of an earlier ``dcp_compile/ops/triton_prefix.py`` (``git show
REV:dcp_compile/ops/triton_prefix.py > old_prefix.py``), loaded under another op name
so that both versions run in one process.  Every arm is first checked against a float64
reference at an 8K context (relative error, every output written); the timed points
use Llama-3-8B heads (Hq=32, Hkv=8, D=128), bf16, every sequence at ``--context``, each
graph reading 512 MiB so that every call reads from HBM.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
COLD_BYTES = 512 * 2**20

# (rows, block_s, num_warps, num_stages) for steps wider than 64 rows per KV head.
WIDE_VARIANTS = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 128, 4, 3)]


def load_old(path: str):
    """The earlier kernel module, registered as ``dcp_exp::prefix_attention_triton_old``
    and without the registrations on ``dcp::prefix_attention``."""
    with open(path) as f:
        source = f.read()
    source = source[:source.index("def _kernel_for(")]
    source = source.replace('"dcp::prefix_attention_triton"', '"dcp_exp::prefix_attention_triton_old"')
    with tempfile.NamedTemporaryFile("w", suffix="_old_prefix.py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_prefix", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prefix_attention_triton


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--tokens", type=int, nargs="*", default=[4, 16, 32, 64])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    from _report import Timer, short_error, timed_rounds
    from dcp_compile.ops.attention import prefix_attention_reference
    from dcp_compile.ops.triton_prefix import prefix_attention_triton

    old = load_old(args.old)
    device, dtype = torch.device("cuda"), torch.bfloat16
    hq, hkv, d = 32, 8, 128
    scale = d ** -0.5
    timer = Timer(device, args.reps, warmup=3)

    def arms_for(tokens: int) -> dict:
        arms = {"old": old, "new": prefix_attention_triton}
        if tokens * hq // hkv > 64:
            for rows, block_s, warps, stages in WIDE_VARIANTS:
                arms[f"r{rows}s{block_s}w{warps}p{stages}"] = functools.partial(
                    prefix_attention_triton, rows=rows, block_s=block_s, num_warps=warps, num_stages=stages)
        return arms

    checks = {}
    for tokens in args.tokens:
        q = torch.randn(2, hq, tokens, d, device=device, dtype=dtype)
        k = torch.randn(2, hkv, 8192, d, device=device, dtype=dtype)
        v = torch.randn(2, hkv, 8192, d, device=device, dtype=dtype)
        kv_len = torch.tensor([8192, 5000], device=device)  # one full, one ending mid-block
        ref_out, ref_lse = prefix_attention_reference(q.double(), k.double(), v.double(), kv_len, scale)
        for name, kernel in arms_for(tokens).items():
            try:
                out, lse = kernel(q, k, v, kv_len, scale)
                torch.cuda.synchronize()
                err = ((out.double() - ref_out).norm() / ref_out.norm()).item()
                lse_err = (lse.double() - ref_lse).abs().max().item()
                checks[f"{tokens}/{name}"] = dict(rel_err=err, lse_err=lse_err, finite=bool(out.isfinite().all()))
            except Exception as exc:  # a variant that does not fit (shared memory, registers) is reported
                checks[f"{tokens}/{name}"] = dict(error=short_error(exc))
            print(f"check T={tokens} {name}: {checks[f'{tokens}/{name}']}", flush=True)

    points = []
    for batch in args.batches:
        kv_bytes = 2 * batch * hkv * args.context * d * 2
        copies = max(1, math.ceil(COLD_BYTES / kv_bytes))
        caches = [(torch.randn(batch, hkv, args.context, d, device=device, dtype=dtype),
                   torch.randn(batch, hkv, args.context, d, device=device, dtype=dtype)) for _ in range(copies)]
        kv_len = torch.full((batch,), args.context, device=device, dtype=torch.int64)
        for tokens in args.tokens:
            q = torch.randn(batch, hq, tokens, d, device=device, dtype=dtype)
            prepared, methods = {}, {}
            for name, kernel in arms_for(tokens).items():
                check = checks.get(f"{tokens}/{name}", {})
                if "error" in check or check.get("rel_err", 1.0) > 2e-2:
                    continue
                calls = [lambda q=q, k=k, v=v, n=kv_len, kernel=kernel: kernel(q, k, v, n, scale) for k, v in caches]
                run, methods[name] = timer.prepare(calls)
                prepared[name] = (run, len(calls), methods[name])
            ms = {name: round(1e3 * s, 4) for name, (s, _) in timed_rounds(prepared, timer, args.rounds).items()}
            flops = 4 * batch * hq * tokens * args.context * d
            point = dict(batch=batch, tokens=tokens, ms=ms, timed_by=methods,
                         tflops={name: round(flops / (t * 1e-3) / 1e12, 1) for name, t in ms.items()})
            points.append(point)
            print(json.dumps(point), flush=True)
        del caches
    summary = dict(context=args.context, checks=checks, points=points, gpu=torch.cuda.get_device_name(),
                   torch=torch.__version__, command=" ".join(["python3", *sys.argv]))
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print("batch tokens  old_ms  new_ms  new/old  best variant")
    for p in points:
        best = min(p["ms"], key=p["ms"].get)
        print(f"{p['batch']:5d} {p['tokens']:6d} {p['ms']['old']:7.4f} {p['ms']['new']:7.4f} "
              f"{p['ms']['new'] / p['ms']['old']:7.3f}  {best} {p['ms'][best]:.4f} ({p['tflops'][best]} TFLOP/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
