"""MLA's latent prefix on one GPU: the Triton latent kernel against DeepSeek's einsum
form, SDPA and the HBM copy ceiling.

    python3 benchmarks/bench_latent_kernel.py --out $OUT/latent.json          # one H200
    python3 benchmarks/bench_latent_kernel.py --sweep --out $OUT/sweep.json   # tile sweep at three points
    python3 benchmarks/bench_latent_kernel.py --smoke --out /tmp/latent.json  # CPU, Triton interpreter

Shapes: a latent of C=512 and a rope key of R=64 per slot (DeepSeek-V2/V3, Kimi-K2), bf16,
every sequence using its whole cache.  Points: memory-bound (H=16, T=1), compute-bound
(H=128, T=1; H=16, T=4 to 16), and T=4 beside T=1 for verify against decode.  Arms:

- ``ours``: ``torch.ops.dcp.latent_prefix_attention`` on CUDA tensors (the Triton latent
  kernel, out fp32 and lse);
- ``einsum``: DeepSeek's reference decode (``model.py``): two score einsums over the
  ``[B, S, C]`` and ``[B, S, R]`` caches, an fp32 softmax, a value einsum over the latent;
- ``sdpa``: ``F.scaled_dot_product_attention`` with keys ``[latent | rope]`` (576 wide, a
  cache of its own) and the latent as values (512), which no fused backend takes;
- ``copy``: ``dst.copy_(src)`` of the cache's size, at most 1 GiB.

Conventions, printed with the results: an attention arm moves the cache bytes it reads,
``B * S * (C + R) * 2``; the copy moves read plus written bytes; ``% copy`` is the
ratio of the two.  TFLOP/s counts ``2 * (C + R)`` for the scores and ``2 * C`` for the
values per head, token and slot.  Timing as ``bench_kernel.py``: medians over
``--rounds`` interleaved rounds of the median of CUDA-graph replays, each graph reading at
least 512 MiB so that no call is served from L2.

``--window`` times the causal form instead (``dcp::latent_window_attention``, a prefill
chunk's T new tokens as keys): positions in order, where each tile of 64 tokens stops at
the last key it sees, against every position equal, where every tile reads every key
(the work of a window without that cut).

``--sweep`` times the kernel alone over ``LATENT_TILE_CHOICES`` (rows per program,
slots per step, warps, pipeline stages) at a memory-bound, a compute-bound and a verify
point, and prints the best tiles beside the defaults.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

C, R = 512, 64
COLD_BYTES = 512 * 2**20
COPY_CAP_BYTES = 2**30
MAX_SCORE_BYTES = 16 * 2**30
"""SDPA's math path and the einsum form hold ``B * H * T * S`` fp32 scores (and more):
points above this skip them rather than run out of memory."""
# (batch, H, T, context)
POINTS = (
    (8, 16, 1, 32768), (8, 16, 1, 65536), (8, 16, 1, 131072), (32, 16, 1, 32768), (32, 16, 1, 131072),
    (8, 16, 4, 32768), (8, 16, 4, 131072), (8, 16, 8, 32768), (8, 16, 16, 32768),
    (8, 128, 1, 8192), (8, 128, 1, 32768), (32, 128, 1, 32768), (8, 128, 4, 8192),
    (32, 128, 1, 8192),  # appended, not sorted in: run scripts under results/ name points by index
)
SWEEP_POINTS = ((8, 16, 1, 65536), (8, 128, 1, 32768), (8, 16, 4, 65536))
SWEEP_STAGES = dict(memory=(2, 3, 4), compute=(2, 3))
"""Pipeline depths tried: a memory-bound point (16 rows) wants loads in flight; the
compute-bound tiles (64 rows of a 512-wide accumulator) leave little shared memory."""
"""The seesaw kernel's two points under 400 TFLOP/s (2026-12-03) and one above."""
SMOKE_POINTS = ((2, 4, 1, 96), (2, 4, 4, 96))
WINDOW_POINTS = ((4, 16, 1024), (4, 16, 2048), (4, 16, 4096), (1, 128, 1024))
"""(batch, H, T) of a prefill chunk's window."""
CHECK_TOLERANCE = dict(out=3e-2, lse=1e-3)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="write the JSON results here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, the kernel under TRITON_INTERPRET=1")
    parser.add_argument("--sweep", action="store_true", help="the kernel's tiles at three points, not the arms")
    parser.add_argument("--window", action="store_true", help="the causal window of a prefill chunk, not the prefix")
    parser.add_argument("--arms", nargs="*", default=("ours", "einsum", "sdpa", "copy"),
                        help="of ours, ours-fp32 (the seesaw kernel with fp32 partials, where it runs), einsum, "
                             "sdpa, copy")
    parser.add_argument("--points", type=int, nargs="*", help="indices into POINTS (default: all)")
    parser.add_argument("--sweep-points", type=int, nargs="*", help="indices into SWEEP_POINTS (default: all)")
    parser.add_argument("--sweep-tiles", nargs="*", default=(), metavar="NAME=V,V",
                        help="replace a sweep dimension, e.g. num_warps=8,16 block_s=64,128")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.ops.triton_interpret import patch_interpreter

    patch_interpreter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from _report import Timer, cell, copy_arms, kilo, short_error, timed_rounds  # noqa: E402
from dcp_compile.ops import latent_prefix_attention_triton, latent_window_attention_triton  # noqa: E402
from dcp_compile.ops.attention import latent_prefix_attention_reference  # noqa: E402
from dcp_compile.ops.triton_latent import LATENT_TILE_CHOICES, latent_tiles  # noqa: E402


def ours_fn(device):
    # On CPU the op is the torch reference, so the smoke run calls the Triton op directly.
    return torch.ops.dcp.latent_prefix_attention if device.type == "cuda" else latent_prefix_attention_triton


def seesaw_fp32_calls(q, caches, kv_len, scale) -> list:
    """The seesaw kernel with its slices' partials in fp32 (the library's are fp16), where the
    library runs it."""
    from dcp_compile.ops import triton_latent

    if triton_latent.gluon_latent is None or not triton_latent.gluon_latent.gluon_latent_fits(q, *caches[0]):
        raise ValueError("the seesaw kernel does not run at this point")
    attend = triton_latent.gluon_latent.seesaw_attention
    return [lambda lat=lat, pe=pe: attend(q, lat, pe, kv_len, scale, partials="fp32") for lat, pe in caches]


def einsum_form(q, kv, pe, scale):
    """DeepSeek's decode attention over ``kv [B, S, C]`` and ``pe [B, S, R]`` caches,
    ``q [B, T, H, C + R]`` (its layout); the latent out ``[B, T, H, C]``."""
    q_lat, q_pe = q[..., :C], q[..., C:]
    scores = (torch.einsum("bshc,btc->bsht", q_lat, kv) + torch.einsum("bshr,btr->bsht", q_pe, pe)) * scale
    probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q)
    return torch.einsum("bsht,btc->bshc", probs, kv)


def flops(batch, heads, tokens, context) -> float:
    return batch * heads * tokens * context * 2.0 * (2 * C + R)


def make_inputs(batch, heads, tokens, context, device, copies, gen):
    q = torch.randn(batch, heads, tokens, C + R, device=device, dtype=torch.bfloat16, generator=gen)
    caches = [(torch.randn(batch, 1, context, C, device=device, dtype=torch.bfloat16, generator=gen),
               torch.randn(batch, 1, context, R, device=device, dtype=torch.bfloat16, generator=gen))
              for _ in range(copies)]
    return q, caches


def check_kernel(device) -> bool:
    """The kernel through the op against the reference, NaN in every slot past kv_len."""
    gen = torch.Generator(device=device).manual_seed(0)
    S = 1000 if device.type == "cuda" else 80
    ok = True
    for heads, tokens in ((16, 1), (16, 4), (128, 1)) if device.type == "cuda" else ((4, 1), (4, 4)):
        q, [(latent, rope)] = make_inputs(3, heads, tokens, S, device, 1, gen)
        kv_len = torch.tensor([0, S, S * 3 // 4 + 5], device=device)
        unused = (torch.arange(S, device=device)[None, :] >= kv_len[:, None])[:, None, :, None]
        out, lse = ours_fn(device)(q, latent.masked_fill(unused, float("nan")), rope.masked_fill(unused, float("nan")),
                                   kv_len, 0.07)
        ref_out, ref_lse = latent_prefix_attention_reference(q.float(), latent.float(), rope.float(), kv_len, 0.07)
        finite = torch.isfinite(ref_lse)
        out_err = (out[finite] - ref_out[finite]).abs().max().item()
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
        empty_ok = bool((lse[~finite] == float("-inf")).all() and (out[0] == 0).all())
        good = out_err <= CHECK_TOLERANCE["out"] and lse_err <= CHECK_TOLERANCE["lse"] and empty_ok
        print(f"check H={heads} T={tokens}: max |out - ref| {out_err:.2e}, max |lse - ref| {lse_err:.2e}, empty rows "
              f"0/-inf: {empty_ok} -> {'ok' if good else 'WRONG'}", flush=True)
        ok &= good
    return ok


def run_point(batch, heads, tokens, context, device, timer) -> dict:
    cache_bytes = batch * context * (C + R) * 2
    point = dict(batch=batch, heads=heads, t=tokens, context=context, cache_bytes=cache_bytes,
                 tiles=latent_tiles(heads * tokens, C + R, 2), arms={})
    gen = torch.Generator(device=device).manual_seed(batch * 7 + heads * 5 + tokens * 3 + context)
    copies = max(1, math.ceil(COLD_BYTES / cache_bytes)) if device.type == "cuda" else 1
    q, caches = make_inputs(batch, heads, tokens, context, device, copies, gen)
    kv_len = torch.full((batch,), context, device=device, dtype=torch.int64)
    scale = (128 + R) ** -0.5
    ours = ours_fn(device)
    score_bytes = batch * heads * tokens * context * 4
    q_deepseek = q.transpose(1, 2).contiguous()
    arms = {
        "ours": lambda: [lambda lat=lat, pe=pe: ours(q, lat, pe, kv_len, scale) for lat, pe in caches],
        "ours-fp32": lambda: seesaw_fp32_calls(q, caches, kv_len, scale),
        "einsum": lambda: [lambda lat=lat, pe=pe: einsum_form(q_deepseek, lat[:, 0], pe[:, 0], scale)
                           for lat, pe in caches],
        "sdpa": lambda: [lambda k=torch.cat([lat, pe], -1), v=lat: F.scaled_dot_product_attention(
            q, k, v, scale=scale, enable_gqa=True) for lat, pe in caches[:1]],
    }
    prepared = {}
    for name in ARGS.arms:
        if name == "copy":
            continue
        if name in ("einsum", "sdpa") and score_bytes * (3 if name == "sdpa" else 2) > MAX_SCORE_BYTES:
            point["arms"][name] = dict(error=f"skipped: {score_bytes / 2**30:.1f} GiB of scores")
            continue
        try:
            calls = arms[name]()
            run, method = timer.prepare(calls)
            prepared[name] = (run, len(calls), method)
        except Exception as exc:  # noqa: BLE001 - one failing arm must not stop the sweep
            point["arms"][name] = dict(error=short_error(exc))
            print(f"  {name} failed at B={batch} H={heads} T={tokens} S={context}: {short_error(exc)}", flush=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    copy_bytes = min(cache_bytes, COPY_CAP_BYTES)
    if "copy" in ARGS.arms:
        prepared.update(copy_arms(timer, device, copy_bytes, COLD_BYTES))
    for name, (seconds, rounds) in timed_rounds(prepared, timer, ARGS.rounds).items():
        ms = seconds * 1e3
        moved = 2 * copy_bytes if name.startswith("copy/") else cache_bytes
        arm = dict(ms=ms, tbps=moved / ms / 1e9, method=prepared[name][2], round_ms=[r * 1e3 for r in rounds])
        if not name.startswith("copy/"):
            arm["tflops"] = flops(batch, heads, tokens, context) / ms / 1e9
        point["arms"][name] = arm
    for name, arm in point["arms"].items():
        if "tflops" in arm:
            print(f"  B={batch} H={heads} T={tokens} S={context} {name}: {arm['ms']:.4f} ms, {arm['tflops']:.0f} "
                  f"TFLOP/s ({arm['method']})", flush=True)
    copy_runs = {n: point["arms"].pop(n) for n in list(point["arms"]) if n.startswith("copy/")}
    if copy_runs:
        point["arms"]["copy"] = max(copy_runs.values(), key=lambda arm: arm["tbps"])
    copy_tbps = point["arms"].get("copy", {}).get("tbps")
    for name, arm in point["arms"].items():
        if copy_tbps and "tflops" in arm:
            arm["pct_copy"] = 100 * arm["tbps"] / copy_tbps
    ours_arm, einsum_arm = point["arms"].get("ours", {}), point["arms"].get("einsum", {})
    if "ms" in ours_arm and "ms" in einsum_arm:
        point["ours_over_einsum_speed"] = einsum_arm["ms"] / ours_arm["ms"]
    del caches, prepared
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return point


def window_point(batch, heads, tokens, device, timer) -> dict:
    """The window kernel over ``tokens`` new tokens: positions in order against all equal."""
    gen = torch.Generator(device=device).manual_seed(batch * 7 + heads * 5 + tokens)
    q, caches = make_inputs(batch, heads, tokens, tokens, device, 1, gen)
    (latent, rope), scale = caches[0], (128 + R) ** -0.5
    window = torch.ops.dcp.latent_window_attention if device.type == "cuda" else latent_window_attention_triton
    in_order = torch.arange(1000, 1000 + tokens, device=device).expand(batch, tokens).contiguous()
    all_equal = torch.full_like(in_order, 1000 + tokens - 1)
    prepared = {}
    for name, positions in (("in_order", in_order), ("all_equal", all_equal)):
        run, method = timer.prepare([lambda p=positions: window(q, latent, rope, p, scale)])
        prepared[name] = (run, 1, method)
    point = dict(batch=batch, heads=heads, t=tokens, arms={})
    for name, (seconds, rounds) in timed_rounds(prepared, timer, ARGS.rounds).items():
        point["arms"][name] = dict(ms=seconds * 1e3, method=prepared[name][2], round_ms=[r * 1e3 for r in rounds])
    point["in_order_over_all_equal"] = point["arms"]["in_order"]["ms"] / point["arms"]["all_equal"]["ms"]
    return point


def sweep_point(batch, heads, tokens, context, device, timer) -> dict:
    """The kernel alone under every tile choice that compiles, best first."""
    cache_bytes = batch * context * (C + R) * 2
    gen = torch.Generator(device=device).manual_seed(context + heads)
    copies = max(1, math.ceil(COLD_BYTES / cache_bytes)) if device.type == "cuda" else 1
    q, caches = make_inputs(batch, heads, tokens, context, device, copies, gen)
    kv_len = torch.full((batch,), context, device=device, dtype=torch.int64)
    default = latent_tiles(heads * tokens, C + R, 2)
    wanted = max(16, triton.next_power_of_2(heads * tokens))
    # 16 rows are the memory-bound tile; wider points try 32 and 64 (T is a runtime
    # argument, so H=16 T=4 reuses H=128's compiled kernels).
    dims = dict(rows=[16] if wanted == 16 else [r for r in LATENT_TILE_CHOICES["rows"] if 32 <= r <= wanted],
                block_s=(16, 32, 64), num_warps=(4, 8),
                num_stages=SWEEP_STAGES["memory" if wanted == 16 else "compute"])
    for text in ARGS.sweep_tiles:
        name, _, values = text.partition("=")
        if name not in dims:
            raise SystemExit(f"--sweep-tiles takes {', '.join(dims)}=V,V...; got {text!r}")
        dims[name] = [int(v) for v in values.split(",")]
    grid = itertools.product(dims["rows"], dims["block_s"], dims["num_warps"], dims["num_stages"])
    results = []
    for rows, block_s, warps, stages in grid:
        tiles = dict(rows=rows, block_s=block_s, num_warps=warps, num_stages=stages)
        calls = [lambda lat=lat, pe=pe, tiles=tiles: latent_prefix_attention_triton(q, lat, pe, kv_len, 0.07, **tiles)
                 for lat, pe in caches]
        try:
            run, _ = timer.prepare(calls)
            ms = timer.measure(run, len(calls)) * 1e3
        except Exception as exc:  # noqa: BLE001 - tiles past the SM's shared memory do not compile
            results.append(dict(tiles, error=short_error(exc)[:160]))
            if device.type == "cuda":
                torch.cuda.synchronize()
            continue
        results.append(dict(tiles, ms=ms, tbps=cache_bytes / ms / 1e9,
                            tflops=flops(batch, heads, tokens, context) / ms / 1e9, default=tiles == default))
        print(f"  B={batch} H={heads} T={tokens} S={context} {tiles}: {ms:.4f} ms, {results[-1]['tbps']:.2f} TB/s, "
              f"{results[-1]['tflops']:.0f} TFLOP/s", flush=True)
    timed = sorted((r for r in results if "ms" in r), key=lambda r: r["ms"])
    del caches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(batch=batch, heads=heads, t=tokens, context=context, default=default, results=timed,
                failed=[r for r in results if "error" in r])


def table(points) -> str:
    head = ("| B | H | T | context | cache GB | ours ms | ours TB/s | ours % copy | ours TFLOP/s | einsum ms "
            "| einsum TB/s | einsum TFLOP/s | ours / einsum speed | SDPA ms | copy TB/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    for p in points:
        o, e, s, c = (p["arms"].get(n, {}) for n in ("ours", "einsum", "sdpa", "copy"))
        speed = f"{p['ours_over_einsum_speed']:.2f}x" if "ours_over_einsum_speed" in p else "-"
        lines.append(
            f"| {p['batch']} | {p['heads']} | {p['t']} | {kilo(p['context'])} | {p['cache_bytes'] / 1e9:.2f} "
            f"| {cell(o, 'ms', '{:.3f}')} | {cell(o, 'tbps', '{:.2f}')} | {cell(o, 'pct_copy', '{:.0f}%')} "
            f"| {cell(o, 'tflops', '{:.0f}')} | {cell(e, 'ms', '{:.3f}')} | {cell(e, 'tbps', '{:.2f}')} "
            f"| {cell(e, 'tflops', '{:.0f}')} | {speed} | {cell(s, 'ms', '{:.3f}')} | {cell(c, 'tbps', '{:.2f}')} |"
        )
    return "\n".join(lines)


def verify_rows(points) -> list[dict]:
    """Per (batch, H, context) measured at T=1 and at T>1: the kernel's time per token."""
    decode = {(p["batch"], p["heads"], p["context"]): p["arms"]["ours"]["ms"] for p in points
              if p["t"] == 1 and "ms" in p["arms"].get("ours", {})}
    rows = []
    for p in points:
        key = (p["batch"], p["heads"], p["context"])
        if p["t"] > 1 and key in decode and "ms" in p["arms"].get("ours", {}):
            per_token = p["arms"]["ours"]["ms"] / p["t"]
            rows.append(dict(batch=key[0], heads=key[1], context=key[2], t=p["t"], decode_ms=decode[key],
                             verify_ms=p["arms"]["ours"]["ms"], per_token_ms=per_token,
                             per_token_over_decode=per_token / decode[key]))
    return rows


def main() -> int:
    started = time.monotonic()
    if ARGS.smoke:
        device = torch.device("cpu")
        timer = Timer(device, 2, 1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU, or pass --smoke for the CPU interpreter run", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        timer = Timer(device, ARGS.reps, ARGS.warmup)
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0],
        command="python3 " + " ".join(sys.argv), shape=dict(C=C, R=R, dtype="bfloat16"),
    )
    print(f"{env['gpu']}; torch {env['torch']}; triton {env['triton']}; command: {env['command']}", flush=True)
    if not check_kernel(device):
        print("the kernel disagrees with the reference: no timings", file=sys.stderr)
        Path(ARGS.out).write_text(json.dumps(dict(env=env, correct=False), indent=1))
        return 1
    if ARGS.window:
        windows = [window_point(*p, device, timer) for p in (((2, 4, 96),) if ARGS.smoke else WINDOW_POINTS)]
        print("\n| B | H | T | in order ms | all equal ms | in order / all equal |\n|---|---|---|---|---|---|")
        for w in windows:
            print(f"| {w['batch']} | {w['heads']} | {w['t']} | {w['arms']['in_order']['ms']:.3f} "
                  f"| {w['arms']['all_equal']['ms']:.3f} | {w['in_order_over_all_equal']:.2f} |", flush=True)
        env["seconds"] = round(time.monotonic() - started, 1)
        Path(ARGS.out).write_text(json.dumps(dict(env=env, correct=True, windows=windows), indent=1))
        return 0
    if ARGS.sweep:
        points = SMOKE_POINTS[:1] if ARGS.smoke else SWEEP_POINTS
        if ARGS.sweep_points is not None:
            points = [points[i] for i in ARGS.sweep_points]
        sweeps = [sweep_point(*p, device, timer) for p in points]
        for s in sweeps:
            best = s["results"][0] if s["results"] else None
            default = next((r for r in s["results"] if r.get("default")), None)
            print(f"B={s['batch']} H={s['heads']} T={s['t']} S={s['context']}: best {best}; default {default}; "
                  f"{len(s['failed'])} tile choices did not run", flush=True)
        env["seconds"] = round(time.monotonic() - started, 1)
        Path(ARGS.out).write_text(json.dumps(dict(env=env, correct=True, sweeps=sweeps), indent=1))
        return 0
    points = []
    chosen = SMOKE_POINTS if ARGS.smoke else [POINTS[i] for i in ARGS.points] if ARGS.points is not None else POINTS
    for batch, heads, tokens, context in chosen:
        point = run_point(batch, heads, tokens, context, device, timer)
        points.append(point)
        summary = ", ".join(f"{n} {a['ms']:.3f} ms" if "ms" in a else f"{n} {a['error'][:60]}"
                            for n, a in point["arms"].items())
        print(f"B={batch} H={heads} T={tokens} S={context}: {summary}  [{time.monotonic() - started:.0f}s]",
              flush=True)
    print("\nAttention TB/s = cache bytes read / time; copy TB/s = (bytes read + written) / time; TFLOP/s counts "
          f"2 * (C + R) + 2 * C = {2 * (2 * C + R)} per head, token and slot.")
    print(table(points))
    verify = verify_rows(points)
    for v in verify:
        print(f"verify T={v['t']} B={v['batch']} H={v['heads']} S={kilo(v['context'])}: {v['per_token_ms']:.4f} ms a "
              f"token against decode {v['decode_ms']:.4f} ms ({v['per_token_over_decode']:.2f}x)")
    env["seconds"] = round(time.monotonic() - started, 1)
    Path(ARGS.out).write_text(json.dumps(dict(env=env, correct=True, points=points, verify=verify), indent=1))
    print(f"\nwrote {ARGS.out} ({env['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
