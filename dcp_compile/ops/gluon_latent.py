"""MLA's latent prefix where compute binds (64 or more query rows a sequence: 128 heads, or
16 heads verifying 4 or more tokens), on Hopper: a Gluon kernel with FlashMLA's "seesaw"
schedule.  ``triton_latent.py`` picks it (``gluon_latent_fits``) over its split-KV kernel.

A program holds 64 query rows (heads x tokens) of one sequence and one slice of its slots,
taken two blocks of 64 slots (a pair) at a time, with two warpgroups:

- warpgroup ``w`` owns output columns ``[256 w, 256 w + 256)`` ([64, 256] fp32, 128
  registers a thread) and block ``2i + w`` of pair ``i``: it alone computes that block's
  scores (one ``[64, 64]`` product over 512 + 64, q in shared memory);
- the two exchange their row maxima through shared memory, so both use one running max
  for the pair; each multiplies its own probabilities (registers) into its half, hands
  them to the other through shared memory, and multiplies the other's into its half.
  While one warpgroup does its softmax the other's products keep the tensor cores busy.

Shared memory (225 KiB of the 227 KiB a block may take): q's latent halves (64 KB), a
pair of slot blocks, each as two latent halves and the rope (144 KB), and the two
probability tiles (16 KB); q's rope part lives in registers.  Each block is loaded by TMA
in two parts that are freed at different times: the owner's value half and the rope after
the owner's own product ("early"), the other value half after the other warpgroup's
("late").  The last user of a part issues its reload for the next pair, and the owner's
scores take the early part first, so a reload overlaps the end of the pair before.

Dead slots: a block that runs past ``kv_len`` reads dead (possibly NaN) slots, or the next
sequence's (the caches are read flattened to ``[B * S, C]``; past the end TMA returns
zeros).  Their scores are set to -inf before the max, and the owner zeroes those latent
rows in shared memory before any value product reads them (``0 * NaN`` is NaN).

Slices: each program's output leaves for the merge (``merge_slices``) as fp16 over its
row's largest magnitude in its value half, the scale in fp32 beside it (``partials``,
default ``PARTIALS[0]``): half the bytes of fp32 to store, every value within 2^-12 of
the row's largest, and no overflow whatever the cache holds.  Against fp32 partials on
one H100 (2026-12-05, ``benchmarks/results/2026-12-05/mla-fp16-partials``): the stores
4.35 -> 2.05 us and the op 0.917x the time at B=8, H=128, T=1, 8K, 0.951x at H=16, T=4,
32K and 0.979-1.003x at the six points where the loop dominates; the error beside fp32's
(3.2e-4 against 3.1e-4).  On one H200, the two forms interleaved (2026-12-06,
``benchmarks/results/2026-12-06/mla-fp16-default-h200``): 405 against 380 TFLOP/s at B=8,
H=128, T=1, 8K and 413 against 401 at H=16, T=4, 32K.

Measured through the registered op with fp32 partials on one H200 (CUDA-graph replays,
2026-12-03, ``benchmarks/exp_latent_gluon.py --graph`` at commit ``376e649``, log in
``benchmarks/results/2026-12-03/mla-gluon``): 514 TFLOP/s at B=8, H=128, T=1, 32K (split-KV
kernel 269, DeepSeek's einsum form 131), 547 at B=32, 391 at 8K, 400 at H=16, T=4 and 574
at H=16, T=16.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dcp_compile.ops.triton_prefix import WIDE_HEAD_SPLITS, _merge_splits, _split_weights, _store_merged, sm_count_of

LATENT_WIDTH, ROPE_WIDTH = 512, 64
"""The only slot shape the kernel takes: DeepSeek-V2/V3's and Kimi-K2's latent and rope key."""
MIN_ROWS = 64
"""Query rows (heads x tokens) of a sequence from which the kernel is used: one program's rows."""
PAIR_SLOTS = 128
"""Slots a program takes a loop step (two blocks of 64); slices are whole pairs."""

_HALF = gl.constexpr(LATENT_WIDTH // 2)
# mbarriers: one slot each, initialized to one arrival
_Q = gl.constexpr(0)  # q has landed
_FULL_E = gl.constexpr(1)  # + block k of the pair: its early part has landed
_FULL_L = gl.constexpr(3)  # + block k: its late part has landed
_P_READY = gl.constexpr(5)  # + warpgroup w: its probabilities are in p_bufs[w]
_P_FREE = gl.constexpr(7)  # + warpgroup w: the other warpgroup has read p_bufs[w]
_STAT = gl.constexpr(9)  # + warpgroup w: its row vector (row max; at the end the row sum) is in stats[w]
_N_BARS = gl.constexpr(11)
_S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
_O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))


@gluon.jit
def _zero_dead_rows(buf, n_live):
    """Rows ``>= n_live`` of a [64, 256] tile in shared memory set to 0, 64 columns at a time."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    for c in gl.static_range(4):
        chunk = buf.slice(c * 64, 64, dim=1)
        x = chunk.load(layout)
        chunk.store(gl.where((rows < n_live)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _load_part(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars, row, k: gl.constexpr, LATE: gl.constexpr):
    """Block ``k`` of a pair, slots from flattened ``row``: its early part (value half ``k``
    and the rope) or its late part (the other value half)."""
    if LATE:
        bar = bars.index(_FULL_L + k)
        mbarrier.expect(bar, lat_desc.block_type.nbytes)
        if k == 0:
            tma.async_copy_global_to_shared(lat_desc, [row, _HALF], bar, kv_r.index(0))
        else:
            tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, kv_l.index(1))
    else:
        bar = bars.index(_FULL_E + k)
        mbarrier.expect(bar, lat_desc.block_type.nbytes + pe_desc.block_type.nbytes)
        if k == 0:
            tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, kv_l.index(0))
        else:
            tma.async_copy_global_to_shared(lat_desc, [row, _HALF], bar, kv_r.index(1))
        tma.async_copy_global_to_shared(pe_desc, [row, 0], bar, kv_p.index(k))


@gluon.jit
def _block_scores(q_mine, q_theirs, q_pe, kv_mine, kv_theirs, kv_p, bars, i, lo, hi, qk_scale, W: gl.constexpr):
    """Scores (log2 units) of block ``2i + W`` [64 rows, 64 slots], -inf past ``hi``; a block
    that runs past ``hi`` has its dead latent rows zeroed before any value product."""
    # A loop-variant zero: the operands' descriptors are made in the loop rather than
    # hoisted out of it into ~150 registers (ptxas spilled them in one of the partitions).
    z = i >> 30
    mbarrier.wait(bars.index(_FULL_E + W), i & 1)
    s = warpgroup_mma(q_mine.index(z), kv_mine.index(W + z).permute((1, 0)),
                      gl.zeros([64, 64], gl.float32, _S_LAYOUT), use_acc=False, is_async=True)
    s = warpgroup_mma(q_pe, kv_p.index(W + z).permute((1, 0)), s, is_async=True)
    mbarrier.wait(bars.index(_FULL_L + W), i & 1)
    s = warpgroup_mma(q_theirs.index(z), kv_theirs.index(W + z).permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    start = lo + (2 * i + W) * 64
    slot = start + gl.arange(0, 64, layout=gl.SliceLayout(0, _S_LAYOUT))
    s = gl.where((slot < hi)[None, :], s * qk_scale, float("-inf"))
    if hi - start < 64:
        _zero_dead_rows(kv_mine.index(W), hi - start)
        _zero_dead_rows(kv_theirs.index(W), hi - start)
        fence_async_shared()
        gl.thread_barrier()
    return s


@gluon.jit
def _pair_softmax(s, m, l, stats, bars, i, W: gl.constexpr):
    """One running max for the pair (this block's row max against the other's): the
    probabilities (bf16), the factor that rescales what came before, the new max and sum."""
    row_s: gl.constexpr = gl.SliceLayout(1, _S_LAYOUT)
    r_max = gl.max(s, axis=1)
    stats.index(W).store(r_max)
    mbarrier.arrive(bars.index(_STAT + W), count=1)
    mbarrier.wait(bars.index(_STAT + 1 - W), i & 1)
    m_new = gl.maximum(m, gl.maximum(r_max, stats.index(1 - W).load(row_s)))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: exp2(-inf) = 0
    alpha = gl.exp2(m - m_use)
    p = gl.exp2(s - m_use[:, None])
    return p.to(gl.bfloat16), alpha, m_new, l * alpha + gl.sum(p, axis=1)


@gluon.jit
def _pair_values(acc, p16, alpha, descs, kv_l, kv_r, kv_p, p_bufs, bars, i, n_pairs, next_row, W: gl.constexpr):
    """``acc`` rescaled, plus this block's and the other block's probabilities times this
    warpgroup's value half; the next pair's parts this warpgroup used last are reloaded."""
    lat_desc, pe_desc = descs
    if W == 0:
        kv_mine = kv_l
    else:
        kv_mine = kv_r
    z = i >> 30
    mbarrier.wait(bars.index(_P_FREE + W), (i & 1) ^ 1)
    p_bufs.index(W).store(p16)
    fence_async_shared()
    mbarrier.arrive(bars.index(_P_READY + W), count=1)

    a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_O_LAYOUT, k_width=2)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, _O_LAYOUT))[:, None]
    acc = warpgroup_mma(gl.convert_layout(p16, a_o), kv_mine.index(W + z), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    if i + 1 < n_pairs:  # this block's early part: its last user was this product
        _load_part(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars, next_row + W * 64, W, False)

    mbarrier.wait(bars.index(_P_READY + 1 - W), i & 1)
    acc = warpgroup_mma(p_bufs.index(1 - W + z), kv_mine.index(1 - W + z), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(bars.index(_P_FREE + 1 - W), count=1)
    if i + 1 < n_pairs:  # the other block's late part: its last user was this product
        _load_part(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars, next_row + (1 - W) * 64, 1 - W, True)
    return acc


@gluon.jit
def _store_rows(acc, l, m, kv_mine, stats, bars, n_pairs, outs, b, rb, split, HT, num_splits, W: gl.constexpr):
    """Both row sums added, then this warpgroup's columns of the slice's output into the
    partials (``_seesaw_outputs``; row ``r`` of sequence ``b`` is ``b * HT + r``) and, from
    warpgroup 0, the lse (natural log).  With ``SCALES`` the columns leave as fp16 over
    their row's largest magnitude, which goes to ``SCALES`` (times ``1 / l``); else as
    fp32 ``acc / l``."""
    O, SCALES, LSE = outs
    row_s: gl.constexpr = gl.SliceLayout(1, _S_LAYOUT)
    row_o: gl.constexpr = gl.SliceLayout(1, _O_LAYOUT)
    stats.index(W).store(l)
    mbarrier.arrive(bars.index(_STAT + W), count=1)
    mbarrier.wait(bars.index(_STAT + 1 - W), n_pairs & 1)
    l = l + stats.index(1 - W).load(row_s)
    seen = l > 0.0
    l_safe = gl.where(seen, l, 1.0)
    if SCALES is None:
        _store_half(acc / gl.convert_layout(l_safe, row_o)[:, None], kv_mine, O, b, rb, split, HT, num_splits, W)
    else:
        # fp16 over the row's largest magnitude: every column within 2^-12 of it, half the
        # bytes of fp32 to write and to merge, and no overflow whatever the cache holds.
        amax = gl.max(gl.abs(acc), axis=1)
        o = acc * (1.0 / gl.where(amax > 0.0, amax, 1.0))[:, None]
        _store_half(o.to(gl.float16), kv_mine, O, b, rb, split, HT, num_splits, W)
        rows_o = rb * 64 + gl.arange(0, 64, layout=row_o)
        gl.store(SCALES + ((b * HT + rows_o) * num_splits + split) * 2 + W, amax / gl.convert_layout(l_safe, row_o),
                 mask=rows_o < HT)
    if W == 0:
        lse = gl.where(seen, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        rows_l = rb * 64 + gl.arange(0, 64, layout=row_s)
        gl.store(LSE + (b * HT + rows_l) * num_splits + split, lse, mask=rows_l < HT)


@gluon.jit
def _store_half(o, kv_mine, O, b, rb, split, HT, num_splits, W: gl.constexpr):
    """``o`` ([64, 256], fp32 or fp16) into columns ``[256 W, 256 W + 256)`` of the slice's
    rows of ``O`` (``[B * HT, num_splits, 512]``)."""
    # Both warpgroups are past their loops and every load has landed: this value half's
    # two blocks (64 KB) stage the output, which leaves in coalesced 64-column pieces.
    # Swizzled by 16-byte vectors: a warp's accumulator fragments cover 8 rows 1 KB (fp16:
    # 512 B) apart, which unswizzled fall on the same banks (an 8-way conflict: 1.4 us of
    # the 8K, 128-head call in fp32).
    vec: gl.constexpr = 128 // o.dtype.primitive_bitwidth
    staging = kv_mine._reinterpret(o.dtype, [64, 256], gl.SwizzledSharedLayout(vec, 1, 8, [1, 0]))
    staging.store(o)
    gl.thread_barrier()
    out_layout: gl.constexpr = gl.BlockedLayout([1, vec], [vec // 2, 64 // vec], [4, 1], [1, 0])
    rows = rb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, out_layout))
    o_rows = ((b * HT + rows) * num_splits + split) * 512 + W * 256
    for c in gl.static_range(4):
        cols = c * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, out_layout))
        piece = staging.slice(c * 64, 64, dim=1).load(out_layout)
        gl.store(O + o_rows[:, None] + cols[None, :], piece, mask=(rows < HT)[:, None])


@gluon.jit
def _stamp(TIMES, slot: gl.constexpr):
    """Experiments only: the global timer (ns) into ``TIMES[program, slot]``."""
    if TIMES is not None:
        pid = (gl.program_id(2) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(0) + gl.program_id(0)
        now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(TIMES + pid * 4 + slot, now)


@gluon.jit
def _warpgroup(descs, q_mine, q_theirs, kv_l, kv_r, shared, scalars, TIMES, W: gl.constexpr):
    """Warpgroup ``W``'s whole part: its output half over the program's slice."""
    kv_p, p_bufs, stats, bars = shared
    outs, qk_scale, b, rb, split, lo, hi, n_pairs, HT, num_splits, kv_row0 = scalars
    if W == 0:
        kv_mine = kv_l
        kv_theirs = kv_r
    else:
        kv_mine = kv_r
        kv_theirs = kv_l
    m = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, _S_LAYOUT))
    l = gl.zeros([64], gl.float32, gl.SliceLayout(1, _S_LAYOUT))
    acc = gl.zeros([64, 256], gl.float32, _O_LAYOUT)
    mbarrier.wait(bars.index(_Q), 0)
    if W == 0:
        _stamp(TIMES, 1)
    q_pe = p_bufs.index(W).load(gl.DotOperandLayout(operand_index=0, parent=_S_LAYOUT, k_width=2))
    for i in range(n_pairs):
        s = _block_scores(q_mine, q_theirs, q_pe, kv_mine, kv_theirs, kv_p, bars, i, lo, hi, qk_scale, W)
        p16, alpha, m, l = _pair_softmax(s, m, l, stats, bars, i, W)
        next_row = kv_row0 + lo + (2 * i + 2) * 64
        acc = _pair_values(acc, p16, alpha, descs, kv_l, kv_r, kv_p, p_bufs, bars, i, n_pairs, next_row, W)
    if W == 0:
        _stamp(TIMES, 2)
    _store_rows(acc, l, m, kv_mine, stats, bars, n_pairs, outs, b, rb, split, HT, num_splits, W)
    if W == 0:
        _stamp(TIMES, 3)


@gluon.jit
def _latent_seesaw_kernel(q_desc, qpe_desc, lat_desc, pe_desc, KV_LEN, O, SCALES, LSE, qk_scale, S, HT, TIMES):
    _stamp(TIMES, 0)
    rb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    # Each program cuts its own sequence's slots, not the cache's capacity: a short
    # sequence in a long cache still spreads over every slice.
    kv_len = gl.load(KV_LEN + b).to(gl.int32)
    split_len = gl.cdiv(kv_len, gl.num_programs(1) * 128) * 128
    lo = split * split_len
    hi = gl.minimum(lo + split_len, kv_len)
    n_pairs = gl.cdiv(gl.maximum(hi - lo, 0), 128)

    q_l = gl.allocate_shared_memory(gl.bfloat16, [1, 64, _HALF], q_desc.layout)
    q_r = gl.allocate_shared_memory(gl.bfloat16, [1, 64, _HALF], q_desc.layout)
    kv_l = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _HALF], lat_desc.layout)
    kv_r = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _HALF], lat_desc.layout)
    kv_p = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], pe_desc.layout)
    p_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], pe_desc.layout)
    stats = gl.allocate_shared_memory(gl.float32, [2, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [_N_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(_N_BARS):
        mbarrier.init(bars.index(i), count=1)

    # q (its rope part into both probability tiles, free until the first pair) and the first pair
    q_row = b * HT + rb * 64
    bar = bars.index(_Q)
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * qpe_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], bar, q_l.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row, _HALF], bar, q_r.index(0))
    tma.async_copy_global_to_shared(qpe_desc, [q_row, 2 * _HALF], bar, p_bufs.index(0))
    tma.async_copy_global_to_shared(qpe_desc, [q_row, 2 * _HALF], bar, p_bufs.index(1))
    if n_pairs > 0:
        for k in gl.static_range(2):
            _load_part(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars, b * S + lo + k * 64, k, False)
            _load_part(lat_desc, pe_desc, kv_l, kv_r, kv_p, bars, b * S + lo + k * 64, k, True)

    shared = (kv_p, p_bufs, stats, bars)
    scalars = ((O, SCALES, LSE), qk_scale, b, rb, split, lo, hi, n_pairs, HT, gl.num_programs(1), b * S)
    gl.warp_specialize([
        (_warpgroup, ((lat_desc, pe_desc), q_l, q_r, kv_l, kv_r, shared, scalars, TIMES, 0)),
        (_warpgroup, ((lat_desc, pe_desc), q_r, q_l, kv_l, kv_r, shared, scalars, TIMES, 1)),
    ], [4], [256])


def seesaw_shapes_fit(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> bool:
    """Whether the seesaw kernel takes these shapes (shapes, dtypes and strides only, so a
    traced graph can ask): bf16, a 512 + 64 slot, at least ``MIN_ROWS`` query rows a
    sequence, contiguous caches (read flattened by TMA, whose coordinates are int32)."""
    B, H, T, width = (int(n) for n in q.shape)
    return (
        q.dtype == latent.dtype == rope.dtype == torch.bfloat16
        and width == LATENT_WIDTH + ROPE_WIDTH and latent.shape[-1] == LATENT_WIDTH
        and rope.shape[-1] == ROPE_WIDTH and latent.shape[1] == 1 and H * T >= MIN_ROWS
        and latent.is_contiguous() and rope.is_contiguous() and B * int(latent.shape[2]) < 2**31
    )


def gluon_latent_fits(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> bool:
    """``seesaw_shapes_fit`` on a Hopper GPU (compute capability 9.0: wgmma and TMA)."""
    on_hopper = q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) == (9, 0)
    return on_hopper and seesaw_shapes_fit(q, latent, rope)


def seesaw_splits(batch: int, row_blocks: int, capacity: int, sm_count: int, num_splits: int | None) -> int:
    """Slices a sequence's slots are cut into: one program an SM (225 KiB of shared memory
    each), so ``sm_count // programs`` of them, no more than the capacity's pairs; or the
    caller's count.  Each program cuts its own sequence's length (``kv_len``) on the device."""
    if num_splits is None:
        wanted = min(sm_count // (batch * row_blocks), WIDE_HEAD_SPLITS)
        return max(1, min(wanted, triton.cdiv(max(capacity, 1), PAIR_SLOTS)))
    if not 1 <= num_splits <= WIDE_HEAD_SPLITS:
        raise ValueError(f"num_splits must lie in [1, {WIDE_HEAD_SPLITS}], got {num_splits}")
    return num_splits


def seesaw_grid(q: torch.Tensor, latent: torch.Tensor, num_splits: int | None = None) -> tuple[int, int, int]:
    """The kernel's grid ``(row blocks, slices, sequences)``: 64 query rows a program,
    ``seesaw_splits``'s slices of each sequence's slots."""
    B, H, T = (int(n) for n in q.shape[:3])
    row_blocks = triton.cdiv(H * T, MIN_ROWS)
    return row_blocks, seesaw_splits(B, row_blocks, int(latent.shape[2]), sm_count_of(q.device), num_splits), B


def _descriptors(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> list:
    """TMA descriptors: q ``[B*H*T, 576]`` as 256-wide and 64-wide boxes of 64 rows, the
    latent ``[B*S, 512]`` in 256-wide boxes, the rope ``[B*S, 64]``."""
    half = gl.NVMMASharedLayout.get_default_for([64, LATENT_WIDTH // 2], gl.bfloat16)
    narrow = gl.NVMMASharedLayout.get_default_for([64, ROPE_WIDTH], gl.bfloat16)
    flat = [t.reshape(-1, t.shape[-1]) for t in (q, latent, rope)]
    for t in flat:
        if t.data_ptr() % 16:
            raise ValueError(f"the latent seesaw kernel reads by TMA, which needs 16-byte aligned tensors; got a "
                             f"{tuple(t.shape)} tensor at {t.data_ptr():#x}")
    boxes = ((flat[0], LATENT_WIDTH // 2, half), (flat[0], ROPE_WIDTH, narrow), (flat[1], LATENT_WIDTH // 2, half),
             (flat[2], ROPE_WIDTH, narrow))
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), [64, width], layout) for t, width, layout in boxes]


PARTIALS = ("fp16", "fp32")
"""How a slice's output reaches the merge, the first the default: fp16 over each value
half's largest magnitude in the row (half the bytes), or fp32."""


def _seesaw_outputs(q: torch.Tensor, num_splits: int, partials: str):
    """What the kernel writes, ``(o_part, scale_part, lse_part)``, each ``[B * H * T,
    num_splits, ...]``: outputs 512 wide (fp32; or fp16, over each value half's largest
    magnitude, the ``[.., 2]`` fp32 scales) and lses.  One slice writes the answer itself:
    fp32, no scales."""
    if partials not in PARTIALS:
        raise ValueError(f"partials must be one of {PARTIALS}, got {partials!r}")
    rows = math.prod(int(n) for n in q.shape[:3])
    lse_part = torch.empty((rows, num_splits), device=q.device, dtype=torch.float32)
    if num_splits == 1 or partials == "fp32":
        return torch.empty((rows, num_splits, LATENT_WIDTH), device=q.device, dtype=torch.float32), None, lse_part
    return (torch.empty((rows, num_splits, LATENT_WIDTH), device=q.device, dtype=torch.float16),
            torch.empty((rows, num_splits, 2), device=q.device, dtype=torch.float32), lse_part)


@triton.jit
def _merge_scaled_kernel(O_PART, SCALE_PART, LSE_PART, O, LSE, num_splits, D: tl.constexpr, SPLITS: tl.constexpr):
    """One row's slices, fp16 with a scale for each half of the ``D`` columns, folded by
    their lses: ``sum_s w_s scale_s o_s / sum_s w_s``."""
    row = tl.program_id(0).to(tl.int64)
    _, shift, total = _split_weights(LSE_PART, row, num_splits, SPLITS)
    cols = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    # Unrolled, so that every slice's loads are in flight at once.
    for s in tl.static_range(SPLITS):
        ok = s < num_splits
        part = row * num_splits + s
        w = tl.exp(tl.load(LSE_PART + part, mask=ok, other=float("-inf")) - shift)
        scale = tl.load(SCALE_PART + part * 2 + cols // (D // 2), mask=ok, other=0.0)
        o = tl.load(O_PART + part * D + cols, mask=ok, other=0.0).to(tl.float32)
        acc += (w * scale) * o
    _store_merged(O, LSE, row, cols, acc, shift, total, D)


def merge_slices(o_part: torch.Tensor, scale_part: torch.Tensor | None, lse_part: torch.Tensor):
    """The kernel's per-slice partials (``_seesaw_outputs``) folded by their lses:
    ``(out fp32 [rows, 512], lse fp32 [rows])``."""
    rows, num_splits = (int(n) for n in lse_part.shape)
    if num_splits == 1:
        return o_part.view(rows, LATENT_WIDTH), lse_part.view(rows)
    out = torch.empty((rows, LATENT_WIDTH), device=o_part.device, dtype=torch.float32)
    lse = torch.empty((rows,), device=o_part.device, dtype=torch.float32)
    if scale_part is None:
        _merge_splits(o_part.view(rows, 1, 1, num_splits, LATENT_WIDTH), lse_part.view(rows, 1, 1, num_splits),
                      out.view(rows, 1, 1, LATENT_WIDTH), lse.view(rows, 1, 1), num_splits)
    else:
        _merge_scaled_kernel[(rows,)](o_part, scale_part, lse_part, out, lse, num_splits, D=LATENT_WIDTH,
                                      SPLITS=triton.next_power_of_2(num_splits), num_warps=4)
    return out, lse


def seesaw_attention(q, latent, rope, kv_len, scale, num_splits=None, times=None, partials=PARTIALS[0]):
    """The seesaw kernel and its merge: ``(out fp32 [B, H, T, 512], lse fp32 [B, H, T])``.
    ``times`` (experiments): int64 ``[programs, 4]``, each program's global timer (ns) at
    its start, when q has landed, after its loop and after its stores.  ``partials``: one
    of ``PARTIALS``."""
    q = q.contiguous()
    _, H, T, _ = q.shape
    grid = seesaw_grid(q, latent, num_splits)
    num_splits = grid[1]
    programs = grid[0] * grid[1] * grid[2]
    if times is not None and (times.dtype != torch.int64 or times.numel() != 4 * programs or times.device != q.device):
        raise ValueError(f"times takes 4 int64 stamps for each of the launch's {programs} programs on {q.device}; got "
                         f"a {times.dtype} tensor of {times.numel()} on {times.device}: size it [programs, 4] from "
                         f"seesaw_grid")
    o_part, scale_part, lse_part = _seesaw_outputs(q, num_splits, partials)
    _latent_seesaw_kernel[grid](
        *_descriptors(q, latent, rope), kv_len, o_part, scale_part, lse_part, scale * 1.4426950408889634,
        int(latent.shape[2]), H * T, times, num_warps=4,
    )
    out, lse = merge_slices(o_part, scale_part, lse_part)
    return out.view(*q.shape[:3], LATENT_WIDTH), lse.view(q.shape[:3])


@torch.library.custom_op("dcp::latent_prefix_attention_gluon", mutates_args=())
def latent_prefix_attention_gluon(
    q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, kv_len: torch.Tensor, scale: float,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``latent_prefix_attention`` by the seesaw kernel (inputs as ``gluon_latent_fits``
    takes them); ``(out fp32 [B, H, T, 512], lse fp32 [B, H, T])``.  An opaque op, so that
    ``torch.compile`` keeps the Gluon launch out of its tracing."""
    return seesaw_attention(q, latent, rope, kv_len, scale, num_splits)


@latent_prefix_attention_gluon.register_fake
def _latent_prefix_attention_gluon_fake(q, latent, rope, kv_len, scale, num_splits=None):
    B, H, T, _ = q.shape
    return q.new_empty((B, H, T, LATENT_WIDTH), dtype=torch.float32), q.new_empty((B, H, T), dtype=torch.float32)
