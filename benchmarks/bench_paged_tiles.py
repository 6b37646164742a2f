"""The paged split-KV kernel against the unpaged one at the same tiles, one GPU: pages of
``--pages`` slots in a shuffled order, each (block_s, num_stages) pair side by side; with
``--flash-tokens T``, the paged flash kernel against the unpaged one on a prefill chunk of
``T`` tokens a sequence instead (default tiles; ms a call).

    python3 benchmarks/bench_paged_tiles.py --out $OUT/paged_tiles.json
    python3 benchmarks/bench_paged_tiles.py --flash-tokens 2048 --points 32:8:2:32768 --out $OUT/paged_flash.json

Timing as in ``bench_kernel.py`` (medians of interleaved rounds of CUDA-graph replays over
enough copies of the cache to miss L2); TB/s = bytes of K and V read / time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from dcp_compile.ops.triton_flash import paged_flash, prefix_flash_triton
from dcp_compile.ops.triton_prefix import split_kv_attention
from _report import Timer, timed_rounds

COLD_BYTES = 512 * 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--points", nargs="*", default=["32:8:8:32768", "16:1:8:32768", "32:8:1:131072"],
                        metavar="HQ:HKV:B:S")
    parser.add_argument("--pages", type=int, nargs="*", default=[16, 64, 128])
    parser.add_argument("--block-s", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--stages", type=int, nargs="*", default=[2, 3, 4])
    parser.add_argument("--prefetch", type=int, nargs="*", default=[0, 1],
                        help="the paged arm reading page ids a block ahead (1) or in the block's own iteration (0)")
    parser.add_argument("--flash-tokens", type=int, default=0, metavar="T",
                        help="time the flash kernels on T new tokens a sequence instead of the split-KV tiles")
    args = parser.parse_args()
    device = torch.device("cuda")
    timer, results = Timer(device, 20, 3), []
    for point in args.points:
        hq, hkv, batch, S = (int(x) for x in point.split(":"))
        d = 128
        kv_bytes = batch * hkv * S * d * 4
        copies = max(1, math.ceil(COLD_BYTES / kv_bytes))
        gen = torch.Generator(device=device).manual_seed(0)
        t = args.flash_tokens or 1
        q = torch.randn(batch, hq, t, d, device=device, dtype=torch.bfloat16, generator=gen)
        kv_len = torch.full((batch,), S, device=device, dtype=torch.int64)
        caches = [[torch.randn(batch, hkv, S, d, device=device, dtype=torch.bfloat16, generator=gen)
                   for _ in range(2)] for _ in range(copies)]
        for page in args.pages:
            n = S // page
            pools = [[c.view(batch, hkv, n, page, d).transpose(1, 2).reshape(batch * n, hkv, page, d) for c in kv]
                     for kv in caches]
            order = torch.randperm(batch * n, device=device, generator=gen)
            pools = [[p[order.argsort()].contiguous() for p in kv] for kv in pools]  # page order[i] holds page i
            table = order.view(batch, n).to(torch.int32)
            prepared = {}
            if args.flash_tokens:
                for name, calls in (("unpaged/flash", [lambda k=k, v=v: prefix_flash_triton(q, k, v, kv_len, 0.088)
                                                       for k, v in caches]),
                                    ("paged/flash", [lambda k=k, v=v: paged_flash(q, k, v, table, kv_len, 0.088)
                                                     for k, v in pools])):
                    run, _ = timer.prepare(calls)
                    prepared[name] = (run, len(calls), "graph")
            for block_s in ([] if args.flash_tokens else args.block_s):
                for stages in args.stages:
                    tuning = dict(block_s=block_s, num_stages=stages)
                    arms = {f"unpaged/{block_s}/{stages}": [
                        lambda k=k, v=v, t=tuning: split_kv_attention(q, k, v, kv_len, 0.088, S, None, t)
                        for k, v in caches]}
                    for ahead in args.prefetch:
                        arms[f"paged/{block_s}/{stages}/{'ahead' if ahead else 'inline'}"] = [
                            lambda k=k, v=v, t=dict(tuning, prefetch=bool(ahead)): split_kv_attention(
                                q, k, v, kv_len, 0.088, S, None, t, table=table, page=page)
                            for k, v in pools]
                    for name, calls in arms.items():
                        run, _ = timer.prepare(calls)
                        prepared[name] = (run, len(calls), "graph")
            if args.flash_tokens:
                check = paged_flash(q, *pools[0], table, kv_len, 0.088)
                expect = prefix_flash_triton(q, *caches[0], kv_len, 0.088)
            else:
                check = split_kv_attention(q, *pools[0], kv_len, 0.088, S, None, None, table=table, page=page)
                expect = split_kv_attention(q, *caches[0], kv_len, 0.088, S)
            same = all(torch.equal(a, b) for a, b in zip(check, expect))
            times = timed_rounds(prepared, timer, 3)
            row = dict(point=point, page=page, tokens=t, same_as_unpaged=same,
                       ms={n: s * 1e3 for n, (s, _) in times.items()},
                       tbps={n: kv_bytes / s / 1e12 for n, (s, _) in times.items()})
            results.append(row)
            best_u = max(v for n, v in row["tbps"].items() if n.startswith("unpaged"))
            best_p = max(v for n, v in row["tbps"].items() if n.startswith("paged"))
            cells = ", ".join(f"{n} {v:.2f} TB/s ({row['ms'][n]:.3f} ms)" for n, v in row["tbps"].items())
            print(f"{point} page {page} (bitwise {same}): best paged {best_p:.2f} / best unpaged {best_u:.2f} = "
                  f"{best_p / best_u:.3f}; {cells}", flush=True)
            del pools, prepared
        del caches
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                              results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
