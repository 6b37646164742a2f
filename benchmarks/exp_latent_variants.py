"""Compute-bound variants of the latent kernel, side by side (H200 experiment).

Each variant is the library's ``_latent_split_kernel`` prefix form with one change:
``chain`` feeds the accumulators into ``tl.dot`` (``dot(p, kv, acc * alpha)``, the rope
scores onto the latent ones), ``qloop`` reloads q inside the loop with loop-invariant
hoisting off (q not held across iterations), ``ws`` asks for Triton's warp
specialization on the loop, ``halves`` keeps the 512-wide accumulator as two 256-wide
ones.  Prints registers and spills, the error against an fp32 reference (ragged
``kv_len``, four slices merged), and median kernel times at two compute-bound points.
BENCHMARKS.md has the one run (2026-12-01): no variant moved the kernel.

    python benchmarks/exp_latent_variants.py
"""

from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.language as tl

from dcp_compile.ops.triton_flash import cache_length
from dcp_compile.ops.triton_prefix import _split_range

C, R = 512, 64


@triton.jit
def _variant_kernel(
    Q, KV, PE, KV_LEN, O, LSE, qk_scale, S, H, num_splits,
    s_qb, s_qh, s_qd, s_cb, s_cs, s_pb, s_ps, s_ob, s_oh, s_os, s_lb, s_lh, s_ls,
    ROWS: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BLOCK_S: tl.constexpr,
    CHAIN: tl.constexpr, QLOOP: tl.constexpr, WS: tl.constexpr, HALVES: tl.constexpr,
):
    split = tl.program_id(0)
    row_block = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    head = (row_block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = head < H
    offs_c = tl.arange(0, C)
    offs_h = tl.arange(0, C // 2)
    offs_r = tl.arange(0, R)
    q_rows = Q + b * s_qb + head[:, None] * s_qh
    if not QLOOP:
        q_lat = tl.load(q_rows + offs_c[None, :] * s_qd, mask=row_ok[:, None], other=0.0)
        q_pe = tl.load(q_rows + (C + offs_r[None, :]) * s_qd, mask=row_ok[:, None], other=0.0)
    lo, hi = _split_range(cache_length(KV_LEN, b, S), num_splits, split, BLOCK_S)
    kv_base = KV + b * s_cb
    pe_base = PE + b * s_pb
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    if HALVES:
        acc0 = tl.zeros([ROWS, C // 2], tl.float32)
        acc1 = tl.zeros([ROWS, C // 2], tl.float32)
    else:
        acc = tl.zeros([ROWS, C], tl.float32)
    for start in tl.range(lo, hi, BLOCK_S, warp_specialize=WS, disable_licm=QLOOP):
        offs_s = start + tl.arange(0, BLOCK_S)
        live = offs_s < hi
        pe = tl.load(pe_base + offs_s[:, None] * s_ps + offs_r[None, :], mask=live[:, None], other=0.0)
        if QLOOP:
            q_lat = tl.load(q_rows + offs_c[None, :] * s_qd, mask=row_ok[:, None], other=0.0)
            q_pe = tl.load(q_rows + (C + offs_r[None, :]) * s_qd, mask=row_ok[:, None], other=0.0)
        if HALVES:
            kv0 = tl.load(kv_base + offs_s[:, None] * s_cs + offs_h[None, :], mask=live[:, None], other=0.0)
            kv1 = tl.load(kv_base + offs_s[:, None] * s_cs + (C // 2 + offs_h[None, :]), mask=live[:, None],
                          other=0.0)
            q0 = tl.load(q_rows + offs_h[None, :] * s_qd, mask=row_ok[:, None], other=0.0)
            q1 = tl.load(q_rows + (C // 2 + offs_h[None, :]) * s_qd, mask=row_ok[:, None], other=0.0)
            scores = tl.dot(q_pe, tl.trans(pe), tl.dot(q1, tl.trans(kv1), tl.dot(q0, tl.trans(kv0))))
        else:
            kv = tl.load(kv_base + offs_s[:, None] * s_cs + offs_c[None, :], mask=live[:, None], other=0.0)
            if CHAIN:
                scores = tl.dot(q_pe, tl.trans(pe), tl.dot(q_lat, tl.trans(kv)))
            else:
                scores = tl.dot(q_lat, tl.trans(kv)) + tl.dot(q_pe, tl.trans(pe))
        scores = tl.where(live[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        m = m_new
        if HALVES:
            acc0 = tl.dot(p.to(kv0.dtype), kv0, acc0 * alpha[:, None])
            acc1 = tl.dot(p.to(kv1.dtype), kv1, acc1 * alpha[:, None])
        elif CHAIN:
            acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None])
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
    seen = l > 0.0
    l_safe = tl.where(seen, l, 1.0)
    lse = tl.where(seen, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_rows = O + b * s_ob + head * s_oh + split * s_os
    if HALVES:
        tl.store(o_rows[:, None] + offs_h[None, :], acc0 / l_safe[:, None], mask=row_ok[:, None])
        tl.store(o_rows[:, None] + (C // 2 + offs_h[None, :]), acc1 / l_safe[:, None], mask=row_ok[:, None])
    else:
        tl.store(o_rows[:, None] + offs_c[None, :], acc / l_safe[:, None], mask=row_ok[:, None])
    tl.store(LSE + b * s_lb + head * s_lh + split * s_ls, lse, mask=row_ok)


VARIANTS = {
    "base": dict(CHAIN=False, QLOOP=False, WS=False, HALVES=False),
    "chain": dict(CHAIN=True, QLOOP=False, WS=False, HALVES=False),
    "qloop": dict(CHAIN=True, QLOOP=True, WS=False, HALVES=False),
    "ws": dict(CHAIN=True, QLOOP=False, WS=True, HALVES=False),
    "halves": dict(CHAIN=True, QLOOP=False, WS=False, HALVES=True),
}
TILES = [dict(block_s=64, num_warps=8, num_stages=2), dict(block_s=32, num_warps=8, num_stages=3),
         dict(block_s=64, num_warps=8, num_stages=3)]


def launch(variant, q, kv, pe, kv_len, num_splits, tiles):
    """q [B, H, C + R] (T=1 rows are heads); returns (partials, their lse, compiled kernel)."""
    B, H, _ = q.shape
    S = kv.shape[1]
    o = torch.empty(B, H, num_splits, C, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H, num_splits, device=q.device, dtype=torch.float32)
    compiled = _variant_kernel[(num_splits, triton.cdiv(H, 64), B)](
        q, kv, pe, kv_len, o, lse, 0.07 * 1.4426950408889634, S, H, num_splits,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), pe.stride(0), pe.stride(1),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        ROWS=64, C=C, R=R, BLOCK_S=tiles["block_s"], num_warps=tiles["num_warps"],
        num_stages=tiles["num_stages"], **VARIANTS[variant],
    )
    return o, lse, compiled


def merged(o, lse):
    weights = torch.softmax(torch.nan_to_num(lse, neginf=-1e30), dim=-1)
    return (o * weights[..., None]).sum(2)


def latent_inputs(B, H, S, dev, kv_len=None):
    """Random bf16 ``q [B, H, C + R]``, latent ``[B, S, C]`` and rope ``[B, S, R]``, and
    the lengths (every slot live unless ``kv_len`` is given)."""
    q = torch.randn(B, H, C + R, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(B, S, C, device=dev, dtype=torch.bfloat16)
    pe = torch.randn(B, S, R, device=dev, dtype=torch.bfloat16)
    lengths = torch.full((B,), S, dtype=torch.int32) if kv_len is None else torch.tensor(kv_len, dtype=torch.int32)
    return q, kv, pe, lengths.to(dev)


def check_variants(launch, variants, tiles_list, inputs, ref) -> list:
    """Every variant at every tiling once, as four merged slices against ``ref``; prints the
    error, registers and spills (or why the compiler refused it) and returns
    ``[(variant, tiles, error)]`` for those that ran."""
    rows = []
    for variant in variants:
        for tiles in tiles_list:
            try:
                o, lse, compiled = launch(variant, *inputs, 4, tiles)
                err = ((merged(o, lse) - ref).norm() / ref.norm()).item()
            except Exception as exc:  # noqa: BLE001 - a variant the compiler refuses is a row of its own
                print(f"{variant} {tiles}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            regs, spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
            rows.append((variant, tiles, err))
            print(f"{variant} {tiles}: err {err:.2e}, {regs} regs, {spills} spills", flush=True)
    return rows


def reference(q, kv, pe, kv_len, scale=0.07):
    """fp32 attention over each sequence's live slots; dead slots are zeroed first, so
    NaN left in them never reaches a product."""
    live = torch.arange(kv.shape[1], device=q.device)[None, :] < kv_len[:, None]
    kv = torch.where(live[..., None], kv.float(), 0.0)
    pe = torch.where(live[..., None], pe.float(), 0.0)
    scores = (torch.einsum("bhc,bsc->bhs", q[..., :C].float(), kv)
              + torch.einsum("bhr,bsr->bhs", q[..., C:].float(), pe)) * scale
    scores = scores.masked_fill(~live[:, None, :], float("-inf"))
    return torch.einsum("bhs,bsc->bhc", scores.softmax(-1), kv)


def main() -> int:
    torch.manual_seed(0)
    if not torch.cuda.is_available():
        raise SystemExit("exp_latent_variants.py times CUDA kernels: run it on a GPU machine")
    dev = torch.device("cuda")
    q, kv, pe, kv_len = latent_inputs(3, 128, 1000, dev, kv_len=(1000, 517, 3))
    ref = reference(q, kv, pe, kv_len)
    rows = check_variants(launch, VARIANTS, TILES, (q, kv, pe, kv_len), ref)
    results = []
    for B, H, S in ((8, 128, 32768), (32, 128, 32768)):
        q, kv, pe, kv_len = latent_inputs(B, H, S, dev)
        splits = max(1, 132 // (B * 2))
        flops = B * H * S * 2.0 * (2 * C + R)
        for variant, tiles, err in rows:
            if err > 2e-2:
                continue
            times = []
            for _ in range(3):
                times.append(triton.testing.do_bench(lambda: launch(variant, q, kv, pe, kv_len, splits, tiles),
                                                     warmup=25, rep=200, return_mode="median"))
            ms = statistics.median(times)
            results.append((B, H, S, variant, tiles, ms, flops / ms / 1e9, min(times), max(times)))
            print(f"B={B} H={H} S={S} {variant} {tiles}: {ms:.4f} ms ({min(times):.4f}-{max(times):.4f}), "
                  f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    print("\n| B | H | S | variant | tiles | ms | TFLOP/s |")
    for B, H, S, variant, tiles, ms, tf, _, _ in results:
        print(f"| {B} | {H} | {S} | {variant} | {tiles['block_s']}/{tiles['num_warps']}/{tiles['num_stages']} "
              f"| {ms:.4f} | {tf:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
