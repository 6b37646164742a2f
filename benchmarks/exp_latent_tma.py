"""The latent kernel's compute-bound form with the slots loaded by tensor descriptors
(Hopper's bulk tensor copy engine), side by side with the library's pointer loads
(H200 experiment).

The pointer form compiles to 250 to 255 registers a thread at H=128, T=1 (64 rows, 64
slots a step, 8 warps), part of them the 64 x 576 addresses and masks of each step's
loads.  Here each program makes descriptors over its own sequence's slots ``[0, hi)``:
the copy engine fills shared memory, rows past ``hi`` come back as zeros (no mask, and a
NaN left in a dead slot never reaches a product), and the loop holds no addresses.
Descriptor boxes are at most 256 wide, so the 512-wide latent comes in two halves
(``LOADS=1``), or whole (``LOADS=2``: one 512-wide box, which Triton splits itself);
``LOADS=0`` is the pointer form.

Prints registers and spills, the error against an fp32 reference (ragged ``kv_len``,
NaN in the dead slots, four slices merged), and median kernel times at the
compute-bound points of BENCHMARKS.md (H=128, T=1, 32K, B=8 and 32).

    python benchmarks/exp_latent_tma.py
"""

from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.language as tl

from dcp_compile.ops.triton_flash import cache_length
from dcp_compile.ops.triton_prefix import _softmax_step, _split_range, _store_partial
from exp_latent_variants import check_variants, latent_inputs, reference

C, R = 512, 64
SCALE = 0.07


@triton.jit
def _latent_kernel(
    Q, KV, PE, KV_LEN, O, LSE, qk_scale, S, H, num_splits,
    s_qb, s_qh, s_cb, s_cs, s_pb, s_ps, s_ob, s_oh, s_os, s_lb, s_lh, s_ls,
    ROWS: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BLOCK_S: tl.constexpr, LOADS: tl.constexpr,
):
    """``LOADS``: 0 pointer loads (the library's form), 1 descriptors with the latent in
    two 256-wide boxes and two accumulators, 2 descriptors with one 512-wide box."""
    split = tl.program_id(0)
    head = (tl.program_id(1) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    row_ok = head < H
    HALF: tl.constexpr = C // 2
    offs_h = tl.arange(0, HALF)
    offs_c = tl.arange(0, C)
    offs_r = tl.arange(0, R)
    q_rows = Q + b * s_qb + head[:, None] * s_qh
    q_pe = tl.load(q_rows + C + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    lo, hi = _split_range(cache_length(KV_LEN, b, S), num_splits, split, BLOCK_S)
    o_rows = b * s_ob + head * s_oh + split * s_os
    lse_rows = b * s_lb + head * s_lh + split * s_ls
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    if LOADS != 0:
        pe_desc = tl.make_tensor_descriptor(PE + b * s_pb, shape=[hi, R], strides=[s_ps, 1], block_shape=[BLOCK_S, R])
    if LOADS == 1:
        q0 = tl.load(q_rows + offs_h[None, :], mask=row_ok[:, None], other=0.0)
        q1 = tl.load(q_rows + HALF + offs_h[None, :], mask=row_ok[:, None], other=0.0)
        lo_desc = tl.make_tensor_descriptor(KV + b * s_cb, shape=[hi, HALF], strides=[s_cs, 1],
                                            block_shape=[BLOCK_S, HALF])
        hi_desc = tl.make_tensor_descriptor(KV + b * s_cb + HALF, shape=[hi, HALF], strides=[s_cs, 1],
                                            block_shape=[BLOCK_S, HALF])
        acc0 = tl.zeros([ROWS, HALF], tl.float32)
        acc1 = tl.zeros([ROWS, HALF], tl.float32)
        for start in range(lo, hi, BLOCK_S):
            kv0 = lo_desc.load([start, 0])
            kv1 = hi_desc.load([start, 0])
            scores = tl.dot(q0, tl.trans(kv0)) + tl.dot(q1, tl.trans(kv1))
            scores += tl.dot(q_pe, tl.trans(pe_desc.load([start, 0])))
            p, alpha, m, l = _softmax_step(scores * qk_scale, (start + tl.arange(0, BLOCK_S)) < hi, m, l)
            acc0 = acc0 * alpha[:, None] + tl.dot(p.to(kv0.dtype), kv0)
            acc1 = acc1 * alpha[:, None] + tl.dot(p.to(kv1.dtype), kv1)
        _store_partial(acc0, m, l, O, LSE, o_rows, lse_rows, offs_h, row_ok)
        _store_partial(acc1, m, l, O + HALF, LSE, o_rows, lse_rows, offs_h, row_ok)
    else:
        q_lat = tl.load(q_rows + offs_c[None, :], mask=row_ok[:, None], other=0.0)
        if LOADS == 2:
            kv_desc = tl.make_tensor_descriptor(KV + b * s_cb, shape=[hi, C], strides=[s_cs, 1],
                                                block_shape=[BLOCK_S, C])
        acc = tl.zeros([ROWS, C], tl.float32)
        for start in range(lo, hi, BLOCK_S):
            offs_s = start + tl.arange(0, BLOCK_S)
            live = offs_s < hi
            if LOADS == 0:
                kv = tl.load(KV + b * s_cb + offs_s[:, None] * s_cs + offs_c[None, :], mask=live[:, None], other=0.0)
                pe = tl.load(PE + b * s_pb + offs_s[:, None] * s_ps + offs_r[None, :], mask=live[:, None], other=0.0)
            else:
                kv = kv_desc.load([start, 0])
                pe = pe_desc.load([start, 0])
            scores = tl.dot(q_lat, tl.trans(kv)) + tl.dot(q_pe, tl.trans(pe))
            p, alpha, m, l = _softmax_step(scores * qk_scale, live, m, l)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        _store_partial(acc, m, l, O, LSE, o_rows, lse_rows, offs_c, row_ok)


VARIANTS = {"pointer": 0, "descriptor-halves": 1, "descriptor-whole": 2}
TILES = [dict(block_s=64, num_warps=8, num_stages=2), dict(block_s=32, num_warps=8, num_stages=3),
         dict(block_s=32, num_warps=8, num_stages=4), dict(block_s=64, num_warps=8, num_stages=3)]


def launch(variant, q, kv, pe, kv_len, num_splits, tiles):
    """q [B, H, C + R] (T=1: the rows are the heads); returns (partials, their lse, compiled kernel)."""
    B, H, _ = q.shape
    o = torch.empty(B, H, num_splits, C, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H, num_splits, device=q.device, dtype=torch.float32)
    compiled = _latent_kernel[(num_splits, triton.cdiv(H, 64), B)](
        q, kv, pe, kv_len, o, lse, SCALE * 1.4426950408889634, kv.shape[1], H, num_splits,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), pe.stride(0), pe.stride(1),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        ROWS=64, C=C, R=R, BLOCK_S=tiles["block_s"], num_warps=tiles["num_warps"],
        num_stages=tiles["num_stages"], LOADS=VARIANTS[variant],
    )
    return o, lse, compiled


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("exp_latent_tma.py times CUDA kernels: run it on a GPU machine")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    # Device-made descriptors live in scratch memory that Triton asks the caller for.
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device=dev, dtype=torch.int8))
    q, kv, pe, kv_len = latent_inputs(3, 128, 1000, dev, kv_len=(1000, 517, 3))
    for row, n in enumerate(kv_len.tolist()):  # dead slots hold NaN: no variant may read them into a product
        kv[row, n:] = float("nan")
        pe[row, n:] = float("nan")
    ref = reference(q, kv, pe, kv_len, SCALE)
    rows = check_variants(launch, VARIANTS, TILES, (q, kv, pe, kv_len), ref)
    times: dict = {}
    for B, H, S in ((8, 128, 32768), (32, 128, 32768)):
        q, kv, pe, kv_len = latent_inputs(B, H, S, dev)
        splits = max(1, 132 // (B * 2))
        for _ in range(3):  # interleaved rounds: every variant once a round
            for variant, tiles, err in rows:
                if err < 2e-2:
                    key = (B, H, S, variant, f"{tiles['block_s']}/{tiles['num_warps']}/{tiles['num_stages']}")
                    times.setdefault(key, []).append(triton.testing.do_bench(
                        lambda: launch(variant, q, kv, pe, kv_len, splits, tiles),
                        warmup=25, rep=200, return_mode="median"))
    print("\n| B | H | S | variant | block_s/warps/stages | ms (min-max) | TFLOP/s |")
    for (B, H, S, variant, tiling), runs in times.items():
        ms = statistics.median(runs)
        print(f"| {B} | {H} | {S} | {variant} | {tiling} | {ms:.4f} ({min(runs):.4f}-{max(runs):.4f}) | "
              f"{B * H * S * 2.0 * (2 * C + R) / ms / 1e9:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
