"""MLA's latent prefix written in Gluon (Triton 3.6's tile language with explicit layouts,
shared memory, TMA, mbarriers and wgmma), side by side with the library's Triton kernel and
DeepSeek's einsum form (H200 experiment, issue #32).

A program holds 64 query rows (heads x tokens) of one sequence and one slice of its slots,
in blocks of 64 slots.  Shared memory: q's latent part [64, 512] (two 256-wide halves), a
ring of two slot blocks (latent halves [64, 256] x 2 and rope [64, 64]) and the
probabilities [64, 64]; q's rope part [64, 64] stays in registers as the A operand of its
product, which leaves room for two probability tiles.  Three forms:

- ``serial``: 8 warps in one partition; the score tile [64, 64] is split by columns across
  the two warpgroups, the 512-wide output into two [64, 256] accumulators also split by
  columns; each step waits for its scores, does the softmax, then the value products.  The
  next block's load is issued a step ahead.
- ``seesaw``: warp-specialized, a loader warp and two consumer warpgroups, each owning one
  half of the 512-wide output ([64, 256] fp32, 128 registers a thread) and, in turn, one
  block of each pair:
  warpgroup w computes the scores of block ``2i + w`` alone, the two exchange their row
  maxima through shared memory (so both use one running max for the pair), each multiplies
  its own probabilities (registers) into its half, publishes them to the other through
  shared memory, then multiplies the other's into its half.  A one-warp loader fills the
  ring by TMA; each block is released in two halves, the owner's value half plus the rope
  after the owner's own product (early), the other value half after the other warpgroup's
  (late), and the owner's scores take the early half first, so a reload overlaps the end
  of the pair before.
- ``seesaw8``: the same two consumers and no loader (8 warps, so 256 registers a thread
  rather than 240): the last user of each half-buffer issues its reload.  This one became
  ``dcp_compile/ops/gluon_latent.py``.

In the consumers the operands' descriptors are indexed by a loop-variant zero (``i >> 30``):
otherwise they are hoisted out of the loop and ptxas spilled them in the second partition.

Dead slots: a block that runs past ``kv_len`` reads slots of the next sequence or dead
(NaN) slots.  Their scores are set to -inf before the max; the owner then zeroes those
rows of the latent tile in shared memory (0 * NaN would poison the value product) before
any value product reads it.  Blocks past the end of the flattened cache come back as zeros.

    python3 benchmarks/exp_latent_gluon.py            # check, then time every point (do_bench)
    python3 benchmarks/exp_latent_gluon.py --check --variants seesaw8
    python3 benchmarks/exp_latent_gluon.py --graph --skip-check --variants seesaw8 serial
    python3 benchmarks/exp_latent_gluon.py --graph --variants   # the registered op, split-KV, einsum

Arms beside the variants: ``library`` (the registered op, which now takes the seesaw kernel
at these points), ``split`` (the split-KV kernel, forced by a tile override) and ``einsum``
(DeepSeek's form).  One H200, 2026-12-03 (``benchmarks/results/2026-12-03/mla-gluon``):
plain ``do_bench`` is bound by host launch cost below ~0.4 ms (the 8K point timed slower
than 32K), so ``--graph`` (CUDA-graph replays) is the measure; with it seesaw8 ran 498,
528, 388, 383 and 563 TFLOP/s at the five points (serial 394, 400, 330, 338, 412).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

C, R = 512, 64
HALF = C // 2
LOG2E = 1.4426950408889634

_HALF = gl.constexpr(HALF)
_R = gl.constexpr(R)
# mbarrier slots of the seesaw kernel
Q_BAR = gl.constexpr(0)
FULL_E = gl.constexpr(1)  # + block of the pair: the owner's value half and the rope have landed
FULL_L = gl.constexpr(3)  # + block: the other value half has landed
EMPTY_E = gl.constexpr(5)
EMPTY_L = gl.constexpr(7)
P_READY = gl.constexpr(9)  # + warpgroup: its probabilities are in p_bufs[w]
P_FREE = gl.constexpr(11)  # + warpgroup: the other warpgroup has read p_bufs[w]
STAT = gl.constexpr(13)  # + warpgroup: its row vector (row max, or at the end its row sum) is in stats[w]
N_BARS = gl.constexpr(16)


@gluon.jit
def _zero_dead_rows(buf, n_live, NUM_WARPS: gl.constexpr):
    """Rows ``>= n_live`` of a [64, 256] bf16 tile in shared memory set to 0, 64 columns at a time."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    for c in gl.static_range(4):
        chunk = buf.slice(c * 64, 64, dim=1)
        x = chunk.load(layout)
        chunk.store(gl.where((rows < n_live)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _load_q_pe(Q, q_row0, rb, HT, s_q, layout: gl.constexpr):
    """q's rope part [64, 64] of this program's rows, straight into the A-operand layout."""
    rows = rb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    ptrs = Q + (q_row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout)))[:, None] * s_q + 512 + cols[None, :]
    return gl.load(ptrs, mask=(rows < HT)[:, None], other=0.0)


@gluon.jit
def _store_half(acc, l, m, O, LSE, b, rb, split, HT, T, s_ob, s_oh, s_ot, s_os, s_lb, s_lh, s_lt, s_ls,
                col0, o_layout: gl.constexpr, STORE_LSE: gl.constexpr):
    """``acc / l`` into columns ``[col0, col0 + 256)`` of the rows' partial output, and the lse (natural log)."""
    seen = l > 0.0
    l_safe = gl.where(seen, l, 1.0)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    rows = rb * 64 + gl.arange(0, 64, layout=row_o)
    cols = col0 + gl.arange(0, 256, layout=gl.SliceLayout(0, o_layout))
    o_rows = b * s_ob + (rows // T) * s_oh + (rows % T) * s_ot + split * s_os
    gl.store(O + o_rows[:, None] + cols[None, :], out, mask=(rows < HT)[:, None])
    if STORE_LSE:
        lse = gl.where(seen, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        rows_l = rb * 64 + gl.arange(0, 64, layout=l.type.layout)
        gl.store(LSE + b * s_lb + (rows_l // T) * s_lh + (rows_l % T) * s_lt + split * s_ls, lse, mask=rows_l < HT)


# ----------------------------------------------------------------------------------------------
# seesaw: two consumer warpgroups and a loader warp
# ----------------------------------------------------------------------------------------------


@gluon.jit
def _seesaw_loader(descs, q_l, q_r, kv_l, kv_r, shared, scalars, kv_row0):
    q_desc, lat_desc, pe_desc = descs
    kv_p, p_bufs, stats, bars = shared
    Q, O, LSE, qk_scale, b, rb, split, lo, hi, n_pairs, HT, T, q_row0, s_q = scalars
    q_desc, qpe_desc = q_desc
    # q's rope part lands in both probability buffers, free until the first pair: each
    # consumer moves it into registers from its own
    mbarrier.expect(bars.index(Q_BAR), 2 * q_desc.block_type.nbytes + 2 * qpe_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0 + rb * 64, 0], bars.index(Q_BAR), q_l.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row0 + rb * 64, _HALF], bars.index(Q_BAR), q_r.index(0))
    tma.async_copy_global_to_shared(qpe_desc, [q_row0 + rb * 64, 2 * _HALF], bars.index(Q_BAR), p_bufs.index(0))
    tma.async_copy_global_to_shared(qpe_desc, [q_row0 + rb * 64, 2 * _HALF], bars.index(Q_BAR), p_bufs.index(1))
    for i in range(n_pairs):
        ph = i & 1
        # early halves first: the owner's value half and the rope, freed mid-pair
        for k in gl.static_range(2):
            row = kv_row0 + lo + (2 * i + k) * 64
            mbarrier.wait(bars.index(EMPTY_E + k), ph ^ 1)
            bar = bars.index(FULL_E + k)
            mbarrier.expect(bar, lat_desc.block_type.nbytes + pe_desc.block_type.nbytes)
            if k == 0:
                tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, kv_l.index(0))
            else:
                tma.async_copy_global_to_shared(lat_desc, [row, _HALF], bar, kv_r.index(1))
            tma.async_copy_global_to_shared(pe_desc, [row, 0], bar, kv_p.index(k))
        for k in gl.static_range(2):
            row = kv_row0 + lo + (2 * i + k) * 64
            mbarrier.wait(bars.index(EMPTY_L + k), ph ^ 1)
            bar = bars.index(FULL_L + k)
            mbarrier.expect(bar, lat_desc.block_type.nbytes)
            if k == 0:
                tma.async_copy_global_to_shared(lat_desc, [row, _HALF], bar, kv_r.index(0))
            else:
                tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, kv_l.index(1))


@gluon.jit
def _seesaw_consumer(q_mine, q_theirs, kv_mine, kv_theirs, shared, scalars, strides, W: gl.constexpr):
    """Warpgroup ``W``: owns output columns ``[256 W, 256 W + 256)`` and block ``2i + W`` of pair i.
    ``q_mine``/``kv_mine`` are that value half, ``*_theirs`` the other."""
    kv_p, p_bufs, stats, bars = shared
    Q, O, LSE, qk_scale, b, rb, split, lo, hi, n_pairs, HT, T, q_row0, s_q = scalars
    s_ob, s_oh, s_ot, s_os, s_lb, s_lh, s_lt, s_ls = strides
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 256, 16])
    a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    m = gl.full([64], float("-inf"), gl.float32, row_s)
    l = gl.zeros([64], gl.float32, row_s)
    acc = gl.zeros([64, 256], gl.float32, o_layout)
    mbarrier.wait(bars.index(Q_BAR), 0)
    q_pe = p_bufs.index(W).load(a_s)
    for i in range(n_pairs):
        ph = i & 1
        # scores of my block; its early half (my value half and the rope) first
        z = i >> 30  # a loop-variant zero, as in _seesaw8_consumer
        mbarrier.wait(bars.index(FULL_E + W), ph)
        s = warpgroup_mma(q_mine.index(z), kv_mine.index(W + z).permute((1, 0)),
                          gl.zeros([64, 64], gl.float32, s_layout), use_acc=False, is_async=True)
        s = warpgroup_mma(q_pe, kv_p.index(W + z).permute((1, 0)), s, is_async=True)
        mbarrier.wait(bars.index(FULL_L + W), ph)
        s = warpgroup_mma(q_theirs.index(z), kv_theirs.index(W + z).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))

        start = lo + (2 * i + W) * 64
        slot = start + gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((slot < hi)[None, :], s * qk_scale, float("-inf"))
        if hi - start < 64:  # the block runs past the slice: zero its dead latent rows before any value product
            _zero_dead_rows(kv_mine.index(W), hi - start, 4)
            _zero_dead_rows(kv_theirs.index(W), hi - start, 4)
            fence_async_shared()
            gl.thread_barrier()

        # one running max for the pair: my block's row max against the other's
        r_max = gl.max(s, axis=1)
        stats.index(W).store(r_max)
        mbarrier.arrive(bars.index(STAT + W), count=1)
        mbarrier.wait(bars.index(STAT + 1 - W), ph)
        m_new = gl.maximum(m, gl.maximum(r_max, stats.index(1 - W).load(row_s)))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_use)
        p = gl.exp2(s - m_use[:, None])
        l = l * alpha + gl.sum(p, axis=1)
        m = m_new
        p16 = p.to(gl.bfloat16)

        mbarrier.wait(bars.index(P_FREE + W), ph ^ 1)
        p_bufs.index(W).store(p16)
        fence_async_shared()
        mbarrier.arrive(bars.index(P_READY + W), count=1)

        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p16, a_o), kv_mine.index(W + z), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(bars.index(EMPTY_E + W), count=1)

        mbarrier.wait(bars.index(P_READY + 1 - W), ph)
        acc = warpgroup_mma(p_bufs.index(1 - W + z), kv_mine.index(1 - W + z), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(bars.index(EMPTY_L + 1 - W), count=1)
        mbarrier.arrive(bars.index(P_FREE + 1 - W), count=1)

    # row sums: each warpgroup summed its own blocks' probabilities
    stats.index(W).store(l)
    mbarrier.arrive(bars.index(STAT + W), count=1)
    mbarrier.wait(bars.index(STAT + 1 - W), n_pairs & 1)
    l = l + stats.index(1 - W).load(row_s)
    # Both warpgroups are past their loops and every load has landed: my value half's two
    # stages (64 KB) stage my fp32 output, which leaves in coalesced 64-column pieces.
    seen = l > 0.0
    l_safe = gl.where(seen, l, 1.0)
    staging = kv_mine._reinterpret(gl.float32, [64, 256], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    staging.store(acc / gl.convert_layout(l_safe, row_o)[:, None])
    gl.thread_barrier()
    out_layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    rows = rb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, out_layout))
    o_rows = b * s_ob + (rows // T) * s_oh + (rows % T) * s_ot + split * s_os + W * 256
    for c in gl.static_range(4):
        cols = c * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, out_layout))
        piece = staging.slice(c * 64, 64, dim=1).load(out_layout)
        gl.store(O + o_rows[:, None] + cols[None, :], piece, mask=(rows < HT)[:, None])
    if W == 0:
        lse = gl.where(seen, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        rows_l = rb * 64 + gl.arange(0, 64, layout=row_s)
        gl.store(LSE + b * s_lb + (rows_l // T) * s_lh + (rows_l % T) * s_lt + split * s_ls, lse, mask=rows_l < HT)


@gluon.jit
def _seesaw_kernel(q_desc, qpe_desc, lat_desc, pe_desc, Q, KV_LEN, O, LSE, qk_scale, S, HT, T, split_len, s_q,
                   s_ob, s_oh, s_ot, s_os, s_lb, s_lh, s_lt, s_ls):
    rb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    kv_len = gl.load(KV_LEN + b).to(gl.int32)
    lo = split * split_len
    hi = gl.minimum(lo + split_len, kv_len)
    n_pairs = gl.cdiv(gl.maximum(hi - lo, 0), 128)

    q_l = gl.allocate_shared_memory(gl.bfloat16, [1, 64, _HALF], q_desc.layout)
    q_r = gl.allocate_shared_memory(gl.bfloat16, [1, 64, _HALF], q_desc.layout)
    kv_l = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _HALF], lat_desc.layout)
    kv_r = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _HALF], lat_desc.layout)
    kv_p = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _R], pe_desc.layout)
    p_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], pe_desc.layout)
    stats = gl.allocate_shared_memory(gl.float32, [2, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [N_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N_BARS):
        mbarrier.init(bars.index(i), count=1)

    shared = (kv_p, p_bufs, stats, bars)
    scalars = (Q, O, LSE, qk_scale, b, rb, split, lo, hi, n_pairs, HT, T, b * HT, s_q)
    strides = (s_ob, s_oh, s_ot, s_os, s_lb, s_lh, s_lt, s_ls)
    # the loader is the default partition (4 warps, whatever registers are left: 24), so that
    # the two consumers are alike workers of 240 registers a thread
    gl.warp_specialize([
        (_seesaw_loader, (((q_desc, qpe_desc), lat_desc, pe_desc), q_l, q_r, kv_l, kv_r, shared, scalars, b * S)),
        (_seesaw_consumer, (q_l, q_r, kv_l, kv_r, shared, scalars, strides, 0)),
        (_seesaw_consumer, (q_r, q_l, kv_r, kv_l, shared, scalars, strides, 1)),
    ], [4, 4], [240, 240])


# ----------------------------------------------------------------------------------------------
# seesaw8: the same two consumers and no loader; each half-buffer is reloaded by its last user
# ----------------------------------------------------------------------------------------------


@gluon.jit
def _seesaw8_load(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars, row, k: gl.constexpr, LATE: gl.constexpr):
    """Half-buffer ``LATE`` of block ``k`` of a pair: early = the owner's value half and the rope, late = the other half."""
    if LATE:
        bar = bars.index(FULL_L + k)
        mbarrier.expect(bar, lat_desc.block_type.nbytes)
        if k == 0:
            tma.async_copy_global_to_shared(lat_desc, [row, _HALF], bar, kv_r.index(0))
        else:
            tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, kv_l.index(1))
    else:
        bar = bars.index(FULL_E + k)
        mbarrier.expect(bar, lat_desc.block_type.nbytes + pe_desc.block_type.nbytes)
        if k == 0:
            tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, kv_l.index(0))
        else:
            tma.async_copy_global_to_shared(lat_desc, [row, _HALF], bar, kv_r.index(1))
        tma.async_copy_global_to_shared(pe_desc, [row, 0], bar, kv_p.index(k))


@gluon.jit
def _seesaw8_consumer(descs, q_mine, q_theirs, kv_l, kv_r, shared, scalars, W: gl.constexpr):
    """As ``_seesaw_consumer``, and it issues the next pair's loads of what it used last: its own
    block's early half after its own product, the other block's late half after the other product."""
    lat_desc, pe_desc = descs
    kv_p, p_bufs, stats, bars = shared
    O, LSE, qk_scale, b, rb, split, lo, hi, n_pairs, HT, num_splits, kv_row0 = scalars
    if W == 0:
        kv_mine = kv_l
        kv_theirs = kv_r
    else:
        kv_mine = kv_r
        kv_theirs = kv_l
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 256, 16])
    a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    m = gl.full([64], float("-inf"), gl.float32, row_s)
    l = gl.zeros([64], gl.float32, row_s)
    acc = gl.zeros([64, 256], gl.float32, o_layout)
    mbarrier.wait(bars.index(Q_BAR), 0)
    q_pe = p_bufs.index(W).load(a_s)
    for i in range(n_pairs):
        ph = i & 1
        # a loop-variant zero: the operands' descriptors are then made in the loop, not hoisted
        # out of it into ~150 registers (ptxas spilled them in one of the two partitions)
        z = i >> 30
        mbarrier.wait(bars.index(FULL_E + W), ph)
        s = warpgroup_mma(q_mine.index(z), kv_mine.index(W + z).permute((1, 0)),
                          gl.zeros([64, 64], gl.float32, s_layout), use_acc=False, is_async=True)
        s = warpgroup_mma(q_pe, kv_p.index(W + z).permute((1, 0)), s, is_async=True)
        mbarrier.wait(bars.index(FULL_L + W), ph)
        s = warpgroup_mma(q_theirs.index(z), kv_theirs.index(W + z).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))

        start = lo + (2 * i + W) * 64
        slot = start + gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((slot < hi)[None, :], s * qk_scale, float("-inf"))
        if hi - start < 64:
            _zero_dead_rows(kv_mine.index(W), hi - start, 4)
            _zero_dead_rows(kv_theirs.index(W), hi - start, 4)
            fence_async_shared()
            gl.thread_barrier()

        r_max = gl.max(s, axis=1)
        stats.index(W).store(r_max)
        mbarrier.arrive(bars.index(STAT + W), count=1)
        mbarrier.wait(bars.index(STAT + 1 - W), ph)
        m_new = gl.maximum(m, gl.maximum(r_max, stats.index(1 - W).load(row_s)))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_use)
        p = gl.exp2(s - m_use[:, None])
        l = l * alpha + gl.sum(p, axis=1)
        m = m_new
        p16 = p.to(gl.bfloat16)

        mbarrier.wait(bars.index(P_FREE + W), ph ^ 1)
        p_bufs.index(W).store(p16)
        fence_async_shared()
        mbarrier.arrive(bars.index(P_READY + W), count=1)

        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p16, a_o), kv_mine.index(W + z), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        next_row = kv_row0 + lo + (2 * i + 2) * 64
        if i + 1 < n_pairs:
            _seesaw8_load(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars, next_row + W * 64, W, False)

        mbarrier.wait(bars.index(P_READY + 1 - W), ph)
        acc = warpgroup_mma(p_bufs.index(1 - W + z), kv_mine.index(1 - W + z), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(bars.index(P_FREE + 1 - W), count=1)
        if i + 1 < n_pairs:
            _seesaw8_load(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars, next_row + (1 - W) * 64, 1 - W, True)

    stats.index(W).store(l)
    mbarrier.arrive(bars.index(STAT + W), count=1)
    mbarrier.wait(bars.index(STAT + 1 - W), n_pairs & 1)
    l = l + stats.index(1 - W).load(row_s)
    seen = l > 0.0
    l_safe = gl.where(seen, l, 1.0)
    staging = kv_mine._reinterpret(gl.float32, [64, 256], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    staging.store(acc / gl.convert_layout(l_safe, row_o)[:, None])
    gl.thread_barrier()
    out_layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    rows = rb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, out_layout))
    # partials are contiguous [B, H, T, num_splits, 512]: row r of sequence b is b * HT + r
    o_rows = ((b * HT + rows) * num_splits + split) * 512 + W * 256
    for c in gl.static_range(4):
        cols = c * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, out_layout))
        piece = staging.slice(c * 64, 64, dim=1).load(out_layout)
        gl.store(O + o_rows[:, None] + cols[None, :], piece, mask=(rows < HT)[:, None])
    if W == 0:
        lse = gl.where(seen, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        rows_l = rb * 64 + gl.arange(0, 64, layout=row_s)
        gl.store(LSE + (b * HT + rows_l) * num_splits + split, lse, mask=rows_l < HT)


@gluon.jit
def _seesaw8_kernel(q_desc, qpe_desc, lat_desc, pe_desc, Q, KV_LEN, O, LSE, qk_scale, S, HT, T, split_len, s_q,
                    s_ob, s_oh, s_ot, s_os, s_lb, s_lh, s_lt, s_ls):
    rb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    num_splits = gl.num_programs(1)
    kv_len = gl.load(KV_LEN + b).to(gl.int32)
    lo = split * split_len
    hi = gl.minimum(lo + split_len, kv_len)
    n_pairs = gl.cdiv(gl.maximum(hi - lo, 0), 128)

    q_l = gl.allocate_shared_memory(gl.bfloat16, [1, 64, _HALF], q_desc.layout)
    q_r = gl.allocate_shared_memory(gl.bfloat16, [1, 64, _HALF], q_desc.layout)
    kv_l = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _HALF], lat_desc.layout)
    kv_r = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _HALF], lat_desc.layout)
    kv_p = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _R], pe_desc.layout)
    p_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], pe_desc.layout)
    stats = gl.allocate_shared_memory(gl.float32, [2, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [N_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N_BARS):
        mbarrier.init(bars.index(i), count=1)

    q_row = b * HT + rb * 64
    kv_row0 = b * S
    # q (its rope part into both probability buffers, free until the first pair) and the first pair
    bar = bars.index(Q_BAR)
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * qpe_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], bar, q_l.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row, _HALF], bar, q_r.index(0))
    tma.async_copy_global_to_shared(qpe_desc, [q_row, 2 * _HALF], bar, p_bufs.index(0))
    tma.async_copy_global_to_shared(qpe_desc, [q_row, 2 * _HALF], bar, p_bufs.index(1))
    if n_pairs > 0:
        for k in gl.static_range(2):
            _seesaw8_load(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars, kv_row0 + lo + k * 64, k, False)
            _seesaw8_load(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars, kv_row0 + lo + k * 64, k, True)

    shared = (kv_p, p_bufs, stats, bars)
    scalars = (O, LSE, qk_scale, b, rb, split, lo, hi, n_pairs, HT, num_splits, kv_row0)
    gl.warp_specialize([
        (_seesaw8_consumer, ((lat_desc, pe_desc), q_l, q_r, kv_l, kv_r, shared, scalars, 0)),
        (_seesaw8_consumer, ((lat_desc, pe_desc), q_r, q_l, kv_l, kv_r, shared, scalars, 1)),
    ], [4], [256])


# ----------------------------------------------------------------------------------------------
# serial: 8 warps, one partition
# ----------------------------------------------------------------------------------------------


@gluon.jit
def _serial_load(lat_desc, pe_desc, kv_l, kv_r, kv_p, bar, row, stage):
    mbarrier.expect(bar, 2 * lat_desc.block_type.nbytes + pe_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, kv_l.index(stage))
    tma.async_copy_global_to_shared(lat_desc, [row, _HALF], bar, kv_r.index(stage))
    tma.async_copy_global_to_shared(pe_desc, [row, 0], bar, kv_p.index(stage))


@gluon.jit
def _serial_kernel(q_desc, qpe_desc, lat_desc, pe_desc, Q, KV_LEN, O, LSE, qk_scale, S, HT, T, split_len, s_q,
                   s_ob, s_oh, s_ot, s_os, s_lb, s_lh, s_lt, s_ls):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 128, 16])
    a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    rb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    kv_len = gl.load(KV_LEN + b).to(gl.int32)
    lo = split * split_len
    hi = gl.minimum(lo + split_len, kv_len)
    n_blocks = gl.cdiv(gl.maximum(hi - lo, 0), 64)

    q_l = gl.allocate_shared_memory(gl.bfloat16, [64, _HALF], q_desc.layout)
    q_r = gl.allocate_shared_memory(gl.bfloat16, [64, _HALF], q_desc.layout)
    kv_l = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _HALF], lat_desc.layout)
    kv_r = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _HALF], lat_desc.layout)
    kv_p = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _R], pe_desc.layout)
    p_buf = gl.allocate_shared_memory(gl.bfloat16, [64, 64], pe_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(bars.index(i), count=1)

    q_row0 = b * HT + rb * 64
    kv_row0 = b * S + lo
    mbarrier.expect(bars.index(2), 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0, 0], bars.index(2), q_l)
    tma.async_copy_global_to_shared(q_desc, [q_row0, _HALF], bars.index(2), q_r)
    if n_blocks > 0:
        _serial_load(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars.index(0), kv_row0, 0)
    q_pe = _load_q_pe(Q, q_row0, rb, HT, s_q, a_s)
    m = gl.full([64], float("-inf"), gl.float32, row_s)
    l = gl.zeros([64], gl.float32, row_s)
    acc_l = gl.zeros([64, 256], gl.float32, o_layout)
    acc_r = gl.zeros([64, 256], gl.float32, o_layout)
    mbarrier.wait(bars.index(2), 0)
    for j in range(n_blocks):
        stage = j % 2
        gl.thread_barrier()  # every warp is done with the stage the next load overwrites
        if j + 1 < n_blocks:
            _serial_load(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars.index(1 - stage), kv_row0 + (j + 1) * 64,
                         1 - stage)
        mbarrier.wait(bars.index(stage), (j // 2) & 1)
        s = warpgroup_mma(q_l, kv_l.index(stage).permute((1, 0)), gl.zeros([64, 64], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        s = warpgroup_mma(q_pe, kv_p.index(stage).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_r, kv_r.index(stage).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        start = lo + j * 64
        slot = start + gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((slot < hi)[None, :], s * qk_scale, float("-inf"))
        if hi - start < 64:
            _zero_dead_rows(kv_l.index(stage), hi - start, 8)
            _zero_dead_rows(kv_r.index(stage), hi - start, 8)
        m_new = gl.maximum(m, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_use)
        p = gl.exp2(s - m_use[:, None])
        l = l * alpha + gl.sum(p, axis=1)
        m = m_new
        p_buf.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.convert_layout(alpha, row_o)[:, None]
        acc_l = warpgroup_mma(p_buf, kv_l.index(stage), acc_l * alpha_o, is_async=True)
        acc_r = warpgroup_mma(p_buf, kv_r.index(stage), acc_r * alpha_o, is_async=True)
        acc_l, acc_r = warpgroup_mma_wait(0, deps=(acc_l, acc_r))
    strides = (s_ob, s_oh, s_ot, s_os, s_lb, s_lh, s_lt, s_ls)
    _store_half(acc_l, l, m, O, LSE, b, rb, split, HT, T, *strides, 0, o_layout, True)
    _store_half(acc_r, l, m, O, LSE, b, rb, split, HT, T, *strides, 256, o_layout, False)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------

VARIANTS = {
    "seesaw8": dict(kernel=_seesaw8_kernel, num_warps=4, maxnreg=None, split_unit=128),
    "seesaw": dict(kernel=_seesaw_kernel, num_warps=4, maxnreg=168, split_unit=128),
    "serial": dict(kernel=_serial_kernel, num_warps=8, maxnreg=None, split_unit=64),
}


def descriptors(q, latent, rope):
    """TMA descriptors over q [B*H*T, 576] (256 and 64 wide), the latent [B*S, 512] and the rope [B*S, 64]."""
    B, H, T, _ = q.shape
    S = latent.shape[2]
    half = gl.NVMMASharedLayout.get_default_for([64, HALF], gl.bfloat16)
    narrow = gl.NVMMASharedLayout.get_default_for([64, R], gl.bfloat16)
    q2 = q.reshape(B * H * T, C + R)
    lat2 = latent.reshape(B * S, C)
    pe2 = rope.reshape(B * S, R)
    return (TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [64, HALF], half),
            TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [64, R], narrow),
            TensorDescriptor(lat2, list(lat2.shape), list(lat2.stride()), [64, HALF], half),
            TensorDescriptor(pe2, list(pe2.shape), list(pe2.stride()), [64, R], narrow))


def num_splits_for(B, row_blocks, S, unit, sm_count=132):
    return max(1, min(sm_count // (B * row_blocks), triton.cdiv(S, unit)))


def gluon_latent(variant, q, latent, rope, kv_len, scale, num_splits=None):
    """q [B, H, T, 576], latent [B, 1, S, 512], rope [B, 1, S, 64] (contiguous bf16); (out fp32, lse)."""
    from dcp_compile.ops.triton_prefix import _merge_splits, _split_outputs

    v = VARIANTS[variant]
    B, H, T, _ = q.shape
    S = latent.shape[2]
    row_blocks = triton.cdiv(H * T, 64)
    unit = v["split_unit"]
    if num_splits is None:
        num_splits = num_splits_for(B, row_blocks, S, unit)
    split_len = triton.cdiv(S, num_splits * unit) * unit
    num_splits = triton.cdiv(S, split_len)
    out, lse, o_part, lse_part, o_strides, l_strides = _split_outputs(q, C, num_splits)
    descs = descriptors(q, latent, rope)
    extra = {} if v["maxnreg"] is None else dict(maxnreg=v["maxnreg"])
    v["kernel"][(row_blocks, num_splits, B)](
        *descs, q, kv_len, o_part, lse_part, scale * LOG2E, S, H * T, T, split_len, q.stride(2),
        *o_strides, *l_strides, num_warps=v["num_warps"], **extra,
    )
    _merge_splits(o_part, lse_part, out, lse, num_splits)
    return out, lse


def einsum_form(q, kv, pe, scale):
    """DeepSeek's decode attention (``model.py``): q [B, T, H, C + R], kv [B, S, C], pe [B, S, R]."""
    q_lat, q_pe = q[..., :C], q[..., C:]
    scores = (torch.einsum("bshc,btc->bsht", q_lat, kv) + torch.einsum("bshr,btr->bsht", q_pe, pe)) * scale
    probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q)
    return torch.einsum("bsht,btc->bshc", probs, kv)


def check(variants, dev) -> dict:
    """Every variant and the library kernel against float64, NaN in every dead slot, ragged
    lengths with a 0, several slice counts; returns {variant: worst relative error}."""
    from dcp_compile.ops.attention import latent_prefix_attention_reference

    worst = {}
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = [(128, 1, 1000, (1000, 517, 0, 63)), (16, 4, 700, (700, 0, 129, 64)), (16, 16, 600, (600, 1, 250)),
             (16, 5, 500, (500, 77)), (128, 1, 300, (300, 299))]
    for H, T, S, lens in cases:
        B = len(lens)
        q = torch.randn(B, H, T, C + R, device=dev, generator=gen).to(torch.bfloat16)
        latent = torch.randn(B, 1, S, C, device=dev, generator=gen).to(torch.bfloat16)
        rope = torch.randn(B, 1, S, R, device=dev, generator=gen).to(torch.bfloat16)
        kv_len = torch.tensor(lens, device=dev)
        dead = (torch.arange(S, device=dev)[None, :] >= kv_len[:, None])[:, None, :, None]
        lat_nan, pe_nan = latent.masked_fill(dead, float("nan")), rope.masked_fill(dead, float("nan"))
        ref, ref_lse = latent_prefix_attention_reference(q.double(), latent.double(), rope.double(), kv_len, 0.07)
        finite = torch.isfinite(ref_lse)
        arms = {"library": lambda: torch.ops.dcp.latent_prefix_attention(q, lat_nan, pe_nan, kv_len, 0.07)}
        for v in variants:
            for splits in (1, 3, None):
                arms[f"{v}/splits={splits}"] = (lambda v=v, splits=splits: gluon_latent(
                    v, q, lat_nan, pe_nan, kv_len, 0.07, num_splits=splits))
        for name, fn in arms.items():
            try:
                out, lse = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - report and go on to the next arm
                print(f"check H={H} T={T} S={S} lens={lens} {name}: FAILED {type(exc).__name__}: {str(exc)[:400]}",
                      flush=True)
                worst[name.split("/")[0]] = float("inf")
                continue
            rel = ((out.double() - ref)[finite].norm() / ref[finite].norm()).item()
            lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
            empty_ok = bool((lse[~finite] == float("-inf")).all() and (out[~finite] == 0).all())
            nan = bool(out.isnan().any() or lse.isnan().any())
            bad = nan or not empty_ok or rel > 1e-2 or lse_err > 1e-2
            print(f"check H={H} T={T} S={S} lens={lens} {name}: rel {rel:.2e}, max |lse err| {lse_err:.2e}, "
                  f"empty rows 0/-inf {empty_ok}, NaN {nan} -> {'WRONG' if bad else 'ok'}", flush=True)
            key = name.split("/")[0]
            worst[key] = max(worst.get(key, 0.0), float("inf") if bad else rel)
    return worst


POINTS = ((8, 128, 1, 32768), (32, 128, 1, 32768), (8, 128, 1, 8192), (8, 16, 4, 32768), (8, 16, 16, 32768))


def flops(B, H, T, S):
    return B * H * T * S * 2.0 * (2 * C + R)


def time_point(B, H, T, S, variants, dev, rounds, graph) -> dict:
    """{arm: [ms a round]} at one point, the arms interleaved within each round."""
    from dcp_compile.ops.triton_latent import latent_prefix_attention_triton

    gen = torch.Generator(device=dev).manual_seed(B + H + T + S)
    q = torch.randn(B, H, T, C + R, device=dev, generator=gen).to(torch.bfloat16)
    latent = torch.randn(B, 1, S, C, device=dev, generator=gen).to(torch.bfloat16)
    rope = torch.randn(B, 1, S, R, device=dev, generator=gen).to(torch.bfloat16)
    kv_len = torch.full((B,), S, device=dev, dtype=torch.int64)
    scale = (128 + R) ** -0.5
    q_ds, kv, pe = q.transpose(1, 2).contiguous(), latent[:, 0], rope[:, 0]
    # "library": the registered op, which picks its kernel (the seesaw kernel of
    # gluon_latent.py here, once integrated); "split": the split-KV kernel, forced by
    # naming its default stage count for 64-row tiles (an override takes that kernel)
    arms = {"library": lambda: torch.ops.dcp.latent_prefix_attention(q, latent, rope, kv_len, scale),
            "split": lambda: latent_prefix_attention_triton(q, latent, rope, kv_len, scale, num_stages=2),
            "einsum": lambda: einsum_form(q_ds, kv, pe, scale)}
    for v in variants:
        arms[v] = lambda v=v: gluon_latent(v, q, latent, rope, kv_len, scale)
    times = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            try:
                if graph:  # replays of a captured graph: no host launch cost in the time
                    times[name].append(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
                else:
                    times[name].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
            except Exception as exc:  # noqa: BLE001 - one failing arm must not stop the others
                print(f"B={B} H={H} T={T} S={S} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                times[name].append(float("nan"))
    return times


def bench(variants, dev, rounds=3, graph=False):
    rows = []
    for B, H, T, S in POINTS:
        for name, ms_list in time_point(B, H, T, S, variants, dev, rounds, graph).items():
            ms = statistics.median(ms_list)
            rows.append((B, H, T, S, name, ms, min(ms_list), max(ms_list), flops(B, H, T, S) / ms / 1e9))
            print(f"B={B} H={H} T={T} S={S} {name}: {ms:.4f} ms ({min(ms_list):.4f}-{max(ms_list):.4f}), "
                  f"{flops(B, H, T, S) / ms / 1e9:.0f} TFLOP/s", flush=True)
        torch.cuda.empty_cache()
    return rows


def resources(variants, dev):
    """Registers, spills and shared memory of each compiled variant (one small launch each)."""
    q = torch.randn(1, 128, 1, C + R, device=dev).to(torch.bfloat16)
    latent = torch.randn(1, 1, 256, C, device=dev).to(torch.bfloat16)
    rope = torch.randn(1, 1, 256, R, device=dev).to(torch.bfloat16)
    kv_len = torch.tensor([256], device=dev)
    for v in variants:
        try:
            gluon_latent(v, q, latent, rope, kv_len, 0.07)
            torch.cuda.synchronize()
            kernel = VARIANTS[v]["kernel"]
            for compiled in kernel.device_caches[0][0].values():
                print(f"{v}: {compiled.n_regs} registers, {compiled.n_spills} spills, "
                      f"{compiled.metadata.shared} bytes of shared memory", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"{v}: FAILED {type(exc).__name__}: {str(exc)[:1500]}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="check only, no timings")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays (do_bench_cudagraph)")
    parser.add_argument("--skip-check", action="store_true", help="time without the check (after a --check run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("exp_latent_gluon.py runs Gluon kernels: run it on a Hopper GPU")
    dev = torch.device("cuda")
    import dcp_compile.ops  # noqa: F401 - registers torch.ops.dcp
    print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}; triton {triton.__version__}; "
          f"command: python3 {' '.join(sys.argv)}", flush=True)
    started = time.monotonic()
    worst = {v: 0.0 for v in args.variants}
    if not args.skip_check:
        resources(args.variants, dev)
        worst = check(args.variants, dev)
    print(f"worst relative error per arm: {worst}  [{time.monotonic() - started:.0f}s]", flush=True)
    good = [v for v in args.variants if worst.get(v, float("inf")) < 1e-2]
    if args.check or len(good) < len(args.variants):
        return 0 if len(good) == len(args.variants) else 1
    rows = bench(good, dev, args.rounds, args.graph)
    print(f"\nTFLOP/s counts 2 * (576 + 512) per head, token and slot; medians of {args.rounds} interleaved rounds "
          f"of {'do_bench_cudagraph' if args.graph else 'do_bench'} medians; every sequence uses its whole cache.")
    print("| B | H | T | S | arm | ms (min-max) | TFLOP/s |\n|---|---|---|---|---|---|---|")
    for B, H, T, S, name, ms, lo, hi, tf in rows:
        print(f"| {B} | {H} | {T} | {S} | {name} | {ms:.4f} ({lo:.4f}-{hi:.4f}) | {tf:.0f} |")
    print(f"[{time.monotonic() - started:.0f}s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
