"""Prefix partial attention on one GPU: the Triton split-KV kernel against SDPA, flex
attention and the HBM copy ceiling, over local context x batch.

    python3 benchmarks/bench_kernel.py --out $OUT/kernel.json        # one H200, ~3 min
    python3 benchmarks/bench_kernel.py --smoke --out /tmp/kernel.json  # CPU, Triton interpreter
    python3 benchmarks/bench_kernel.py --heads 16:1 --arms ours copy --out $OUT/kernel.json  # gathered heads

Shapes: Hq=32, Hkv=8, D=128, bf16, T=1 (decode), plus T=4 (verify) at two points;
``--heads HQ:HKV`` sets the query and KV heads instead (e.g. ``16:1``: the D x Hq/T query heads
a DCP rank holds after gathering its peers' queries inside tensor parallelism, over one KV head);
every sequence uses its whole local context (kv_len = S), and ``--fill`` points hold
shorter sequences in a larger cache (the slice count comes from the capacity, each
sequence's length is cut into the slices on the device).  Arms:

- ``ours``: ``torch.ops.dcp.prefix_attention`` on CUDA tensors (the Triton kernel, out
  fp32 and lse);
- ``sdpa``: ``F.scaled_dot_product_attention(..., enable_gqa=True)``, no lse;
- ``flex``: ``torch.compile(flex_attention)`` with the lse and a kv_len block mask;
- ``copy``: ``dst.copy_(src)`` of a tensor of the KV size, at most 1 GiB (timed in a
  graph and eagerly; the faster counts).

Bandwidth conventions, printed with the results: an attention arm moves the bytes of K
and V it reads, ``B * Hkv * S * D * 2 (K and V) * 2 (bf16)``; the copy moves the bytes it
reads plus the bytes it writes (the usual copy-bandwidth convention).  ``% copy`` is the
attention arm's TB/s over the copy's.

Each timing is the median over ``--rounds`` interleaved rounds (every arm once per
round) of the median over ``--reps`` replays of a CUDA graph (CUDA events; eager
launches if capture fails, as the ``method`` field says).  Where one call reads less
than 512 MiB, the graph calls the arm on several copies of K/V in turn, so every call
reads from HBM rather than from the 60 MB L2.  A failing arm prints its error and the
sweep goes on.  The run starts with a correctness check of the kernel against the
reference and exits 1 if it is wrong.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072, 262144)
BATCHES = (1, 8, 64)
VERIFY_POINTS = ((8, 8192), (8, 65536))  # (batch, context) also run with T=4
MAX_KV_BYTES = 60e9
COLD_BYTES = 512 * 2**20  # bytes one timed graph reads at least: ~8x the H200's L2
COPY_CAP_BYTES = 2**30
SMOKE = dict(contexts=(200, 333), batches=(1, 2), verify=((2, 333),), fill=((2, 333, 70),), hq=8, hkv=2, d=64, reps=3,
             warmup=1)
# Correctness: the kernel rounds probabilities to bf16 before the PV product.
CHECK_TOLERANCE = dict(out=3e-2, lse=1e-3)


def parse_fill(text: str) -> tuple[int, int, int]:
    try:
        batch, capacity, live = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--fill takes B:CAPACITY:KV_LEN, e.g. 8:65536:8192; got {text!r}") from None
    if not 0 < live <= capacity or batch < 1:
        raise SystemExit(f"--fill {text}: need B >= 1 and 0 < KV_LEN <= CAPACITY")
    return batch, capacity, live


def parse_heads(text: str) -> tuple[int, int]:
    try:
        hq, hkv = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--heads takes HQ:HKV, e.g. 16:1; got {text!r}") from None
    if hkv < 1 or hq < hkv or hq % hkv:
        raise SystemExit(f"--heads {text}: need HKV >= 1 and HQ a multiple of HKV")
    return hq, hkv


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="write the JSON results here")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU, the kernel under TRITON_INTERPRET=1, perf_counter timing")
    parser.add_argument("--contexts", type=int, nargs="*", default=CONTEXTS)
    parser.add_argument("--batches", type=int, nargs="*", default=BATCHES)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--arms", nargs="*", default=("ours", "sdpa", "flex", "copy"))
    parser.add_argument("--heads", type=parse_heads, metavar="HQ:HKV",
                        help="query and KV heads (default 32:8; the smoke run's own 8:2 unless given)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of every arm per point; the median of the rounds counts")
    parser.add_argument("--fill", nargs="*", default=["8:65536:8192", "8:65536:32768", "1:65536:8192"],
                        metavar="B:CAPACITY:KV_LEN",
                        help="extra points where every sequence holds KV_LEN tokens of a CAPACITY-slot cache")
    parser.add_argument("--splits", type=int, nargs="*", default=[], metavar="N",
                        help="extra arms: the Triton kernel with N slices a sequence forced, beside split_plan's own")
    parser.add_argument("--page-size", type=int, default=0, metavar="P",
                        help="add the paged arm: dcp::paged_prefix_attention over pools of P-slot pages, in a "
                             "shuffled order, of the same bytes as the unpaged arm's caches")
    parser.add_argument("--flex-budget-s", type=float, default=150.0,
                        help="skip the flex arm (its compiles) once the run is this old")
    return parser.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    # Read when triton is imported, so set before anything imports it.
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.ops.triton_interpret import patch_interpreter

    patch_interpreter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from dcp_compile.ops import attention_with_lse, paged_prefix_attention_triton, prefix_attention_triton  # noqa: E402
from dcp_compile.ops import triton_prefix  # noqa: E402
from _report import Timer, cell, copy_arms, kilo, short_error, timed_rounds  # noqa: E402


def ours_fn(device):
    # On CPU the op is the torch reference, so the smoke run calls the Triton op directly.
    return torch.ops.dcp.prefix_attention if device.type == "cuda" else prefix_attention_triton


def check_kernel(device, hq, hkv, d) -> bool:
    """The kernel through the op against the fp32 reference on clean K/V, with NaN in
    every slot past kv_len; ragged lengths 0, S and one that ends mid-block."""
    gen = torch.Generator(device=device).manual_seed(0)
    ok = True
    S = 1000 if device.type == "cuda" else 150
    for t in (1, 4):
        q = torch.randn(3, hq, t, d, device=device, generator=gen, dtype=torch.bfloat16)
        k = torch.randn(3, hkv, S, d, device=device, generator=gen, dtype=torch.bfloat16)
        v = torch.randn(3, hkv, S, d, device=device, generator=gen, dtype=torch.bfloat16)
        kv_len = torch.tensor([0, S, S * 3 // 4 + 5], device=device)
        unused = (torch.arange(S, device=device)[None, :] >= kv_len[:, None])[:, None, :, None]
        out, lse = ours_fn(device)(q, k.masked_fill(unused, float("nan")), v.masked_fill(unused, float("nan")),
                                   kv_len, d**-0.5)
        allowed = (torch.arange(S, device=device)[None, :] < kv_len[:, None])[:, None, :]
        ref_out, ref_lse = attention_with_lse(q, k, v, allowed, d**-0.5)
        finite = torch.isfinite(ref_lse)
        out_err = (out - ref_out).abs().max().item()
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
        empty_ok = bool((lse[~finite] == float("-inf")).all() and (out[0] == 0).all())
        good = (out_err <= CHECK_TOLERANCE["out"] and lse_err <= CHECK_TOLERANCE["lse"] and empty_ok
                and not torch.isnan(out).any().item())
        print(f"check T={t}: max |out - ref| {out_err:.2e} (tol {CHECK_TOLERANCE['out']}), max |lse - ref| "
              f"{lse_err:.2e} (tol {CHECK_TOLERANCE['lse']}), empty rows 0/-inf: {empty_ok} -> "
              f"{'ok' if good else 'WRONG'}")
        ok &= good
    return ok


def flex_arm(device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    try:
        from torch.nn.attention.flex_attention import AuxRequest

        lse_kwargs = dict(return_aux=AuxRequest(lse=True))
    except ImportError:  # torch releases before return_aux
        lse_kwargs = dict(return_lse=True)
    compiled = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention

    def make(q, copies, kv_len, scale):
        def live(b, h, q_idx, kv_idx):
            return kv_idx < kv_len[b]

        mask = create_block_mask(live, q.shape[0], None, q.shape[2], copies[0][0].shape[2], device=device)
        return [lambda k=k, v=v: compiled(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, **lse_kwargs)
                for k, v in copies]

    return make


def paged_calls(q, kv_len, scale, batch, hkv, context, d, n_copies, gen, device):
    """The paged op over ``n_copies`` pools holding every sequence's ``context`` slots in
    pages of ``--page-size``, each pool's pages handed out in a shuffled order."""
    page = ARGS.page_size
    n = -(-context // page)
    calls = []
    for _ in range(n_copies):
        k_pool, v_pool = (torch.randn(batch * n, hkv, page, d, device=device, dtype=torch.bfloat16, generator=gen)
                          for _ in range(2))
        table = torch.randperm(batch * n, device=device, generator=gen).view(batch, n).to(torch.int32)
        # On CPU the op is the reference, so the smoke run calls the Triton op directly.
        op = torch.ops.dcp.paged_prefix_attention if device.type == "cuda" else paged_prefix_attention_triton
        calls.append(lambda k=k_pool, v=v_pool, t=table, op=op: op(q, k, v, t, kv_len, scale))
    return calls


def paged_table(points) -> str:
    """The paged arm beside the unpaged kernel: TB/s and their ratio."""
    lines = ["| heads | B | context | T | page | ours TB/s | paged TB/s | paged / ours |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        o, g = p["arms"].get("ours", {}), p["arms"].get("paged", {})
        ratio = f"{g['tbps'] / o['tbps']:.3f}" if "tbps" in o and "tbps" in g else "-"
        lines.append(f"| {p['hq']}:{p['hkv']} | {p['batch']} | {kilo(p['context'])} | {p['t']} | {ARGS.page_size} "
                     f"| {cell(o, 'tbps', '{:.2f}')} | {cell(g, 'tbps', '{:.2f}')} | {ratio} |")
    return "\n".join(lines)


def run_point(batch, context, t, cfg, device, timer, started, kv_len_value=None):
    """Every arm at one point, timed in ``--rounds`` interleaved rounds (ours, SDPA, flex,
    copy, ours, ...), so drift in the GPU's clocks over the run hits every arm alike.

    ``kv_len_value`` below ``context`` sets every sequence's length in a cache of
    ``context`` slots (ours reads the live slots only; SDPA gets the live slices)."""
    hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["d"]
    live = context if kv_len_value is None else kv_len_value
    kv_bytes = batch * hkv * live * d * 2 * 2
    point = dict(batch=batch, hq=hq, hkv=hkv, context=live, capacity=context, t=t, kv_bytes=kv_bytes, arms={})
    row_blocks = triton.cdiv(hq // hkv * t, triton_prefix.MAX_ROWS)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else \
        triton_prefix.DEFAULT_SM_COUNT
    block_s = triton_prefix.default_block_s(d, 2)
    point["num_splits"], _ = triton_prefix.split_plan(batch, hkv, row_blocks, context, block_s, sms)
    gen = torch.Generator(device=device).manual_seed(batch * 1000 + context + t)
    n_copies = max(1, math.ceil(COLD_BYTES / kv_bytes)) if device.type == "cuda" else 1
    q = torch.randn(batch, hq, t, d, device=device, dtype=torch.bfloat16, generator=gen)
    copies = [(torch.randn(batch, hkv, context, d, device=device, dtype=torch.bfloat16, generator=gen),
               torch.randn(batch, hkv, context, d, device=device, dtype=torch.bfloat16, generator=gen))
              for _ in range(n_copies)]
    kv_len = torch.full((batch,), live, device=device, dtype=torch.int64)
    scale = d**-0.5
    ours = ours_fn(device)
    arms = {
        "ours": lambda: [lambda k=k, v=v: ours(q, k, v, kv_len, scale) for k, v in copies],
        "sdpa": lambda: [lambda k=k[:, :, :live], v=v[:, :, :live]:
                         F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True) for k, v in copies],
        "flex": lambda: flex_arm(device)(q, copies, kv_len, scale),
    }
    if ARGS.page_size:
        arms["paged"] = lambda: paged_calls(q, kv_len, scale, batch, hkv, context, d, len(copies), gen, device)
    for n in ARGS.splits:
        arms[f"splits{n}"] = lambda n=n: [lambda k=k, v=v: prefix_attention_triton(q, k, v, kv_len, scale, num_splits=n)
                                          for k, v in copies]
    prepared = {}  # name -> (run, calls per run, method)
    extra = [*(["paged"] if ARGS.page_size else []), *(f"splits{n}" for n in ARGS.splits)]
    for name in [*ARGS.arms, *extra]:
        if name == "copy":
            continue
        if name == "flex" and (time.monotonic() - started > ARGS.flex_budget_s or live != context):
            why = "a partly filled cache" if live != context else f"run older than --flex-budget-s={ARGS.flex_budget_s}"
            point["arms"][name] = dict(error=f"skipped: {why}")
            continue
        try:
            if name == "flex" and device.type == "cuda":
                torch._dynamo.reset()  # a fresh compile per shape, never the recompile limit's eager fallback
            calls = arms[name]()
            run, method = timer.prepare(calls)
            prepared[name] = (run, len(calls), method)
        except Exception as exc:  # noqa: BLE001 - one failing arm must not stop the sweep
            point["arms"][name] = dict(error=short_error(exc))
            print(f"  {name} failed at B={batch} context={live} T={t}: {short_error(exc)}", flush=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
    copy_bytes = min(kv_bytes, COPY_CAP_BYTES)
    if "copy" in ARGS.arms:
        prepared.update(copy_arms(timer, device, copy_bytes, COLD_BYTES))
    for name, (seconds, rounds) in timed_rounds(prepared, timer, ARGS.rounds).items():
        moved = 2 * copy_bytes if name.startswith("copy/") else kv_bytes
        point["arms"][name] = dict(ms=seconds * 1e3, tbps=moved / seconds / 1e12, method=prepared[name][2],
                                   round_ms=[r * 1e3 for r in rounds])
    copy_runs = {n: point["arms"].pop(n) for n in list(point["arms"]) if n.startswith("copy/")}
    if copy_runs:
        best = max(copy_runs.values(), key=lambda arm: arm["tbps"])
        point["arms"]["copy"] = dict(best, copied_bytes=copy_bytes,
                                     timings={n.split("/", 1)[1]: r for n, r in copy_runs.items()})
    copy_tbps = point["arms"].get("copy", {}).get("tbps")
    for name, arm in point["arms"].items():
        if copy_tbps and "tbps" in arm and name != "copy":
            arm["pct_copy"] = 100 * arm["tbps"] / copy_tbps
    del copies, prepared
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return point


def table(points) -> str:
    head = ("| heads | B | context | T | KV GB | splits | ours ms | ours TB/s | ours % copy | SDPA TB/s | SDPA % copy "
            "| flex TB/s | copy TB/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    for p in points:
        a = p["arms"]
        o, s, f, c = (a.get(n, {}) for n in ("ours", "sdpa", "flex", "copy"))
        context = kilo(p["context"])
        if p.get("capacity", p["context"]) != p["context"]:
            context += f" of {kilo(p['capacity'])}"
        lines.append(
            f"| {p['hq']}:{p['hkv']} | {p['batch']} | {context} | {p['t']} | {p['kv_bytes'] / 1e9:.2f} "
            f"| {p['num_splits']} "
            f"| {cell(o, 'ms', '{:.3f}')} | {cell(o, 'tbps', '{:.2f}')} | {cell(o, 'pct_copy', '{:.0f}%')} "
            f"| {cell(s, 'tbps', '{:.2f}')} | {cell(s, 'pct_copy', '{:.0f}%')} | {cell(f, 'tbps', '{:.2f}')} "
            f"| {cell(c, 'tbps', '{:.2f}')} |"
        )
    return "\n".join(lines)


def split_table(points) -> str:
    """The forced slice counts' % of copy beside split_plan's choice."""
    names = [f"splits{n}" for n in ARGS.splits]
    head = "| heads | B | context | T | planned splits | ours % copy | " + " | ".join(
        f"{n} splits % copy" for n in ARGS.splits) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in points:
        a = p["arms"]
        cells = " | ".join(cell(a.get(n, {}), "pct_copy", "{:.0f}%") for n in names)
        lines.append(f"| {p['hq']}:{p['hkv']} | {p['batch']} | {kilo(p['context'])} | {p['t']} | {p['num_splits']} "
                     f"| {cell(a.get('ours', {}), 'pct_copy', '{:.0f}%')} | {cells} |")
    return "\n".join(lines)


def main() -> int:
    started = time.monotonic()
    if ARGS.smoke:
        device = torch.device("cpu")
        hq, hkv = ARGS.heads or (SMOKE["hq"], SMOKE["hkv"])
        cfg = dict(hq=hq, hkv=hkv, d=SMOKE["d"])
        contexts, batches, verify, fill = SMOKE["contexts"], SMOKE["batches"], SMOKE["verify"], SMOKE["fill"]
        timer = Timer(device, SMOKE["reps"], SMOKE["warmup"])
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU, or pass --smoke for the CPU interpreter run", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        hq, hkv = ARGS.heads or (32, 8)
        cfg = dict(hq=hq, hkv=hkv, d=128)
        contexts, batches, verify = ARGS.contexts, ARGS.batches, VERIFY_POINTS
        fill = [parse_fill(f) for f in ARGS.fill]
        timer = Timer(device, ARGS.reps, ARGS.warmup)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        gpu=gpu, sms=torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None,
        torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0],
        command="python3 " + " ".join(sys.argv), config=dict(cfg, dtype="bfloat16"),
        kernel=dict(block_s=triton_prefix.default_block_s(cfg["d"], 2), num_warps=triton_prefix.NUM_WARPS,
                    num_stages=triton_prefix.NUM_STAGES),
        conventions=dict(attention="TB/s = bytes of K and V read / time",
                         copy="TB/s = (bytes read + bytes written) / time",
                         pct_copy="attention TB/s / copy TB/s",
                         timing="median of CUDA-event timed graph replays (copy: the faster of graph and eager)"),
    )
    print(f"{env['gpu']}; torch {env['torch']}; triton {env['triton']}; python {env['python']}; "
          f"heads {cfg['hq']}:{cfg['hkv']}, D={cfg['d']}")
    print(f"command: {env['command']}")
    if not check_kernel(device, **cfg):
        print("the kernel disagrees with the reference: no timings", file=sys.stderr)
        Path(ARGS.out).write_text(json.dumps(dict(env=env, correct=False), indent=1))
        return 1

    plan = [(b, s, 1, None) for s in contexts for b in batches] + [(b, s, 4, None) for b, s in verify]
    plan += [(b, s, 1, live) for b, s, live in fill]
    points = []
    for batch, context, t, live in plan:
        kv_bytes = batch * cfg["hkv"] * context * cfg["d"] * 4
        if kv_bytes > MAX_KV_BYTES:
            print(f"skip B={batch} context={context}: {kv_bytes / 1e9:.1f} GB of KV > {MAX_KV_BYTES / 1e9:.0f} GB")
            continue
        point = run_point(batch, context, t, cfg, device, timer, started, live)
        points.append(point)
        summary = ", ".join(f"{n} {a['tbps']:.2f} TB/s" if "tbps" in a else f"{n} {a['error'][:60]}"
                            for n, a in point["arms"].items())
        print(f"B={batch} context={point['context']} capacity={context} T={t} splits={point['num_splits']}: {summary}  "
              f"[{time.monotonic() - started:.0f}s]", flush=True)
    print()
    print("Attention TB/s = bytes of K and V read / time; copy TB/s = (bytes read + written) / time; "
          "% copy = attention TB/s / copy TB/s.")
    print(table(points))
    if ARGS.splits:
        print()
        print(split_table(points))
    if ARGS.page_size:
        print()
        print(paged_table(points))
    env["seconds"] = round(time.monotonic() - started, 1)
    Path(ARGS.out).write_text(json.dumps(dict(env=env, correct=True, points=points), indent=1))
    print(f"\nwrote {ARGS.out} ({env['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
