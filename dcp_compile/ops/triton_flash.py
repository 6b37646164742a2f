"""Triton flash-attention (prefill) kernels for ``dcp::prefix_attention`` and
``dcp::window_attention`` on CUDA.

The torch ops in ``attention.py`` stay the specification, the CPU path and the test
oracle.  This module is their GPU path for long chunks of new tokens: a prefill of
``T`` tokens over ``S`` cached slots (prefix) or over its own ``T`` keys (window).
Each program holds one tile of query rows and walks the keys in blocks with an online
softmax (fp32 accumulation, base-2 exponentials, fp32 natural-log ``lse`` out), so no
``T x S`` or ``T x T`` scores ever exist, in HBM or anywhere else.

Contract, shared with the reference: ``q [B,Hq,T,D]``; keys ``[B,Hkv,S,D]`` and values
``[B,Hkv,S,Dv]`` (``S = T`` in the window form); query head ``h`` reads KV head
``h // (Hq // Hkv)``; out fp32 ``[B,Hq,T,Dv]``, lse fp32 ``[B,Hq,T]``; a row that sees no
key gets ``out = 0`` and ``lse = -inf``.  Any strides; bf16, fp16 or fp32 (fp32 dots in
``ieee`` precision); ``D`` and ``Dv`` each at most 256, neither necessarily a power of
two: the kernels run a power-of-two tile (``kernel_width``) and mask its head axis past
each width, so nothing is padded in memory.

- **Tile.**  The ``G = Hq // Hkv`` query heads of a KV group are packed into the
  tile's rows, token-major (row ``r`` is token ``r // G`` of head ``r % G`` of the
  group), so the K/V blocks a program loads serve all ``G`` heads: a KV head is read
  by ``G`` times fewer programs, and a tile still covers a contiguous run of tokens,
  which is what the window form's block skipping needs.
- **Prefix** (``WINDOW=False``): keys are slots ``[0, kv_len[b])``, non-causal.  The
  length is read on the device and bounds the key loop, so slots past it are never
  loaded and the host never syncs: shapes alone fix the launch, which keeps it
  CUDA-graph capturable.
- **Window** (``WINDOW=True``): keys are the ``T`` new tokens, query ``t`` sees key
  ``s`` iff ``positions[b, s] <= positions[b, t]``.  Each program first scans the
  positions (ints only, ``SCAN_BLOCK`` at a time) for the last key any of its queries
  can see, and stops its key loop there, and for the first key some query cannot see.
  Both bounds are exact for any positions; for the usual ascending ones they are the
  tile's own last and first tokens, so a causal prefill does half the work, and only
  the one or two blocks between them need the position mask.  Tiles are launched
  heaviest first so the short ones fill the tail of the grid.

**Left padding** (``kv_start`` for the prefix, ``lower`` for the window; the op
arguments of the same names): each row's keys begin at a bound, local slot
``kv_start[b]`` of the prefix, global position ``lower[b]`` of the window.  The prefix
loop starts at the block holding ``kv_start[b]``; the window's position scan also finds
the first key a tile's queries can see at or past ``lower[b]`` and starts there.  Keys
below the bound are masked at the load, like those past the length, so pad slots may
hold anything.

**Tree mask** (``ancestors``, the window op's argument of that name): query ``t`` sees
key ``s`` iff ``ancestors[b, t, s]`` (bool ``[B, T, T]``), and no longer by position:
siblings share a position, and an ancestor mask need not keep a tile's visible keys one
range.  The loop then runs all ``T`` keys (a tree verify has at most a few hundred),
skips no block by the position scan and masks every block: each one loads its
``BLOCK_M x BLOCK_N`` tile of the mask (one byte an entry; the padding rows repeat the
last token's) and sets the scores of keys a row may not see to ``-inf``.  Keys that no
row of the tile sees are not loaded either, and with ``lower`` the keys below the bound
stay unloaded as above, so both may hold anything; a key some row of the tile sees is
a real token, weighted 0 for the rows that do not see it.

Keys past the loop bound (slots past ``kv_len``, which may hold NaN) are masked at the
load with ``other=0``, and in every block that is not wholly visible the scores of
keys a row may not see are set to ``-inf`` with ``tl.where``: a NaN in an unused slot
is never loaded, so ``0 * NaN`` cannot happen.  A row whose running max is still
``-inf`` shifts by 0 instead, so ``exp2(-inf - -inf)`` never happens either.

The ops ``prefix_flash_triton`` and ``window_flash_triton`` are ``torch.library``
triton_ops, registered the way ``triton_prefix.py`` explains: ``window_attention``
reaches its kernel here (eager CUDA calls and ``torch.compile``), ``prefix_attention``
through ``triton_prefix.py``, which sends it the steps whose tiles fill the GPU (prefill
chunks; ``prefix_kernel``) and the others (decode, verify) to its split-KV kernel.
Both run on CPU tensors under ``TRITON_INTERPRET=1``, which is how the CI tests run
them.  On the H200 at Llama-3-8B heads (bf16, D=128) they ran at 1.0-1.5x the speed
of SDPA's FLASH backend in the window form (T = 512..4096) and 1.3-1.7x in the prefix
form (``benchmarks/bench_prefill_kernels.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op, wrap_triton

from dcp_compile.ops.inlining import kernels_inlined
from dcp_compile.ops.attention import check_ancestors, window_attention, window_attention_reference
from dcp_compile.ops.kernel_checks import (  # noqa: F401 - the other kernels' modules import them from here
    SUPPORTED_DTYPES, check_index, check_inputs, check_lower, kernel_width,
)

BLOCK_SIZES = (16, 32, 64, 128)
"""What ``block_m`` / ``block_n`` overrides may take (16 is ``tl.dot``'s smallest tile)."""
NARROW_ROW_BYTES = 256
"""A head row of at most this many bytes (bf16 D <= 128, fp32 D <= 64) gets the wide
tiles below; wider rows get the narrow one."""
PREFIX_TILE = (128, 64, 8, 4)
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefix form for narrow rows: 128
query rows over two warpgroups' MMAs, and a deep pipeline since the loop runs the
whole cache.  With bf16 D=128: Q (32 KB) plus four stages of K and V (4 x 32 KB) is
160 KB of the H200's 227 KB; 128-key blocks in three stages (224 KB) ran no faster."""
WINDOW_TILE = (128, 64, 8, 3)
"""The window form's: a causal chunk's tiles see T/2 keys on average, so their loops
are short and a third stage fills faster than a fourth pays (~2% on the H200)."""
NARROW_TILE = (64, 32, 4, 2)
"""For wide rows (bf16 D=256, fp32 D >= 128), both forms: the fp32 accumulator of
64 x 256 already takes 128 registers a thread in one warpgroup, and Q plus two stages
of K/V stay at 96 KB (bf16 D=256) to 160 KB (fp32 D=256) of shared memory."""
SCAN_BLOCK = 1024
"""Positions the window kernel scans per step while bounding its key loop: a few
steps even for long chunks, four ints a thread."""
LOG2E = 1.4426950408889634


@triton.jit
def cache_length(KV_LEN, b, S):
    """Sequence ``b``'s cache length clamped to ``[0, S]``: a bad length never reads past
    the cache (the split kernels of ``triton_prefix.py`` share it)."""
    return tl.minimum(tl.maximum(tl.load(KV_LEN + b), 0), S).to(tl.int32)


@triton.jit
def window_bounds(POS_ROW, s_post, T, q_min, q_max, SCAN: tl.constexpr):
    """Of the ``T`` new tokens at ``POS_ROW`` as keys, for a tile of queries at positions
    ``[q_min, q_max]``: ``full``, before which every key is seen by every query, and
    ``hi``, from which no key is seen by any (the latent window kernel shares it)."""
    full = tl.full([], 0, tl.int32) + T
    hi = tl.full([], 0, tl.int32)
    for start in range(0, T, SCAN):
        offs = start + tl.arange(0, SCAN)
        in_range = offs < T
        k_pos = tl.load(POS_ROW + offs * s_post, mask=in_range, other=0)
        full = tl.minimum(full, tl.min(tl.where(in_range & (k_pos > q_min), offs, T), 0))
        hi = tl.maximum(hi, tl.max(tl.where(in_range & (k_pos <= q_max), offs + 1, 0), 0))
    return full, hi


@triton.jit
def window_bounds_from(POS_ROW, s_post, T, q_min, q_max, low, SCAN: tl.constexpr):
    """``window_bounds`` where keys at positions below ``low`` are seen by no query:
    ``first``, before which no key is seen by any query of the tile; ``full``, from
    ``first`` up to which every key is seen by every query; and ``hi``, from which no
    key is seen by any.  Keys below ``low`` may lie anywhere, so ``full`` takes a second
    scan, from ``first``."""
    first = tl.full([], 0, tl.int32) + T
    hi = tl.full([], 0, tl.int32)
    for start in range(0, T, SCAN):
        offs = start + tl.arange(0, SCAN)
        in_range = offs < T
        k_pos = tl.load(POS_ROW + offs * s_post, mask=in_range, other=0)
        seen = in_range & (k_pos >= low) & (k_pos <= q_max)
        first = tl.minimum(first, tl.min(tl.where(seen, offs, T), 0))
        hi = tl.maximum(hi, tl.max(tl.where(seen, offs + 1, 0), 0))
    full = tl.full([], 0, tl.int32) + T
    for start in range(0, T, SCAN):
        offs = start + tl.arange(0, SCAN)
        in_range = offs < T
        k_pos = tl.load(POS_ROW + offs * s_post, mask=in_range, other=0)
        partly = in_range & (offs >= first) & ((k_pos > q_min) | (k_pos < low))
        full = tl.minimum(full, tl.min(tl.where(partly, offs, T), 0))
    return first, full, hi


@triton.jit
def slot_rows(table_row, offs_s, live, s_kp, s_ks, s_vp, s_vs, last_page, PAGE: tl.constexpr,
               MASKED: tl.constexpr):
    """Offsets of logical slots ``offs_s`` in K and V: the slots themselves, or (``PAGE`` > 0)
    page ``table_row[slot // PAGE]``'s row ``slot % PAGE`` (a page id outside the pool is
    clamped into it, so a bad table reads wrong keys, never outside the pool)."""
    if PAGE == 0:
        k_rows = offs_s * s_ks
        v_rows = offs_s * s_vs
    else:
        if MASKED:
            page = tl.load(table_row + offs_s // PAGE, mask=live, other=0).to(tl.int64)
        else:
            page = tl.load(table_row + offs_s // PAGE).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), last_page)
        within = offs_s % PAGE
        k_rows = page * s_kp + within * s_ks
        v_rows = page * s_vp + within * s_vs
    return k_rows, v_rows


@triton.jit
def _flash_fwd_kernel(
    Q, K, V, KV_LEN, POS, LOWER, ANC, O, LSE,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    T, S, G,
    s_qb, s_qh, s_qt, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_pb, s_pt,
    s_lowb,
    s_ab, s_at, s_as,
    s_ob, s_oh, s_ot, s_od,
    s_lb, s_lh, s_lt,
    WINDOW: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, HAS_LOWER: tl.constexpr,
    HAS_ANCESTORS: tl.constexpr, TABLE, s_tb, last_page, PAGE: tl.constexpr,
):
    # D is the tile's head width, a power of two; q and the keys are DK wide, the values
    # and the output DV (transformers' expanded MLA: 192 and 128), read and written
    # unpadded under a mask on the head axis where a width falls short of D.
    pid_m = tl.program_id(0)
    if WINDOW:
        # Later tiles see more keys: start them first so the light ones fill the tail.
        pid_m = tl.num_programs(0) - 1 - pid_m
    kv_head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # b * batch stride can pass 2**31 elements

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * T
    # Padding rows repeat the last token, so every load below stays in bounds unmasked
    # and the tile's smallest and largest positions are those of real rows.
    tok = tl.minimum(rows // G, T - 1).to(tl.int64)
    head = (kv_head * G + rows % G).to(tl.int64)
    offs_d = tl.arange(0, D)
    k_cols = offs_d < DK
    v_cols = offs_d < DV
    q_ptrs = Q + b * s_qb + head[:, None] * s_qh + tok[:, None] * s_qt + offs_d[None, :] * s_qd
    if DK == D:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=k_cols[None, :], other=0.0)

    # Keys [first, hi) are the loop's; [first, full) is seen whole by every row.
    first = tl.full([], 0, tl.int32)
    if WINDOW:
        pos_base = POS + b * s_pb
        q_pos = tl.load(pos_base + tok * s_pt)
        q_min = tl.min(q_pos, 0)
        q_max = tl.max(q_pos, 0)
        if HAS_LOWER:
            low = tl.load(LOWER + b * s_lowb)
        if HAS_ANCESTORS:
            # Positions say nothing of a tree's visibility: every key is the loop's and
            # no block is seen whole, so each one reads its tile of the mask.
            hi = tl.full([], 0, tl.int32) + T
            full = tl.full([], 0, tl.int32)
            anc_rows = ANC + b * s_ab + tok * s_at
        elif HAS_LOWER:
            first, full, hi = window_bounds_from(pos_base, s_pt, T, q_min, q_max, low, SCAN)
        else:
            full, hi = window_bounds(pos_base, s_pt, T, q_min, q_max, SCAN)
    else:
        hi = cache_length(KV_LEN, b, S)
        full = hi
        if HAS_LOWER:
            first = tl.minimum(tl.maximum(tl.load(LOWER + b * s_lowb), 0), hi).to(tl.int32)

    offs_n = tl.arange(0, BLOCK_N)
    lo_block = (first // BLOCK_N) * BLOCK_N
    # Paged (PAGE > 0, the prefix form): K and V are [pages, Hkv, PAGE, D] pools, their first
    # stride a page's, read through row b of TABLE (slot_rows) block by block.
    k_ptrs = (K + b * s_kb + kv_head.to(tl.int64) * s_kh + lo_block.to(tl.int64) * s_ks + offs_n[:, None] * s_ks
              + offs_d[None, :] * s_kd)
    v_ptrs = (V + b * s_vb + kv_head.to(tl.int64) * s_vh + lo_block.to(tl.int64) * s_vs + offs_n[:, None] * s_vs
              + offs_d[None, :] * s_vd)
    if PAGE > 0:
        table_row = TABLE + b * s_tb
        k_head = K + kv_head.to(tl.int64) * s_kh + offs_d[None, :] * s_kd
        v_head = V + kv_head.to(tl.int64) * s_vh + offs_d[None, :] * s_vd
        # Page ids are read a block ahead, so that no K or V load waits on a load of its own iteration.
        k_rows, v_rows = slot_rows(table_row, lo_block + offs_n, lo_block + offs_n < hi, s_kb, s_ks, s_vb, s_vs,
                                   last_page, PAGE, True)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo_block, hi, BLOCK_N):
        keys = start + offs_n
        live = keys < hi
        if HAS_LOWER:
            # Keys below the bound are never loaded: pad slots may hold NaN.
            if WINDOW:
                live = live & (tl.load(pos_base + keys * s_pt, mask=live, other=0) >= low)
            else:
                live = live & (keys >= first)
        if HAS_ANCESTORS:
            anc = tl.load(anc_rows[:, None] + keys[None, :] * s_as, mask=live[None, :], other=0) != 0
            # A key no row of the tile sees is not loaded: 0 * NaN cannot reach the sum.
            live = live & (tl.max(anc.to(tl.int32), 0) > 0)
        if PAGE > 0:
            k_ptrs = k_head + k_rows[:, None]
            v_ptrs = v_head + v_rows[:, None]
            ahead = keys + BLOCK_N
            k_rows, v_rows = slot_rows(table_row, ahead, ahead < hi, s_kb, s_ks, s_vb, s_vs, last_page, PAGE, True)
        if DK == D:  # the mask on the head axis only where it masks something
            k = tl.load(k_ptrs, mask=live[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=live[:, None] & k_cols[None, :], other=0.0)
        if DV == D:
            v = tl.load(v_ptrs, mask=live[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=live[:, None] & v_cols[None, :], other=0.0)
        # The cast pins fp32 where a caller (Inductor) passes qk_scale as an fp64 scalar.
        scores = (tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale).to(tl.float32)
        # Blocks inside [0, full) are live and seen by every row: only the others need
        # the mask.  Skipping it there made the window form ~1.5x faster on the H200;
        # a second, unmasked loop instead spilled registers (two pipelined loops).
        if (start + BLOCK_N > full) | (start < first):
            if HAS_ANCESTORS:
                visible = live[None, :] & anc
            elif WINDOW:
                k_pos = tl.load(pos_base + keys * s_pt, mask=live, other=0)
                visible = live[None, :] & (k_pos[None, :] <= q_pos[:, None])
            else:
                visible = live[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # A row that has seen no key yet keeps m = -inf: shift it by 0 so its weights
        # are exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        p = tl.exp2(scores - shift[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
        # Pointer steps stay 64-bit even where start * stride would not fit 32 bits.
        k_ptrs += BLOCK_N * s_ks
        v_ptrs += BLOCK_N * s_vs

    seen_any = l > 0.0
    l_safe = tl.where(seen_any, l, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen_any, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # to natural log
    o_ptrs = O + b * s_ob + head[:, None] * s_oh + tok[:, None] * s_ot + offs_d[None, :] * s_od
    if DV == D:
        tl.store(o_ptrs, out, mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, out, mask=row_ok[:, None] & v_cols[None, :])
    tl.store(LSE + b * s_lb + head * s_lh + tok * s_lt, lse, mask=row_ok)


def flash_config(head_dim: int, element_size: int, window: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of one form for a head row of ``head_dim`` elements."""
    if head_dim * element_size > NARROW_ROW_BYTES:
        return NARROW_TILE
    return WINDOW_TILE if window else PREFIX_TILE


def scan_block(T: int, window: bool) -> int:
    """Positions a window kernel scans a step for its tile's key range (a power of two
    up to ``SCAN_BLOCK``); the prefix forms read none, so they take the smallest."""
    return max(16, min(SCAN_BLOCK, triton.next_power_of_2(T))) if window else 16


def _blocks(q: torch.Tensor, width: int, window: bool, block_m: int | None,
            block_n: int | None) -> tuple[int, int, int, int]:
    default_m, default_n, num_warps, num_stages = flash_config(width, q.element_size(), window)
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None and value not in BLOCK_SIZES:
            raise ValueError(f"{name} must be one of {BLOCK_SIZES}, got {value}")
    return block_m or default_m, block_n or default_n, num_warps, num_stages


def _flash(q, k, v, kv_len, positions, scale, block_m, block_n, lower=None, ancestors=None, table=None):
    """Launch the kernel in the prefix form (``kv_len`` given) or the window form;
    ``lower``: the rows' left-padding bounds (``kv_start`` of the prefix, ``lower`` of
    the window); ``ancestors``: the window's tree mask; ``table``: the prefix form over
    ``[pages, Hkv, P, D]`` pools through a block table ``[B, n]`` (``n * P`` slots a row)."""
    window = positions is not None
    # Shapes fix the grid and the tile sizes: a graph traced with symbolic sizes
    # specializes on them here.
    B, Hq, T, DK = (int(n) for n in q.shape)
    Hkv, S, DV = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    # Unpaged launches pass the table's arguments too (never read): Inductor's wrapper of
    # the kernel takes every argument, defaults included.
    paging = dict(TABLE=positions if kv_len is None else kv_len, s_tb=0, last_page=0, PAGE=0) if table is None else dict(
        TABLE=table, s_tb=table.stride(0), last_page=int(k.shape[0]) - 1, PAGE=S)
    S = S if table is None else int(table.shape[1]) * S
    D = kernel_width(DK, DV)
    out = torch.empty((B, Hq, T, DV), device=q.device, dtype=torch.float32)
    lse = torch.empty((B, Hq, T), device=q.device, dtype=torch.float32)
    if B * Hq * T == 0:
        return out, lse
    BLOCK_M, BLOCK_N, num_warps, num_stages = _blocks(q, D, window, block_m, block_n)
    G = Hq // Hkv
    # The unused one of kv_len / positions gets the other's pointer (never read).
    meta = positions if window else kv_len
    pos_strides = positions.stride() if window else (0, 0)
    scan = scan_block(T, window)
    grid = (triton.cdiv(G * T, BLOCK_M), Hkv, B)
    # The bool mask goes in as it is (one byte an entry, loaded as int1): a dtype view of
    # it would not lower in Inductor (no bitcast from bool).
    anc = meta if ancestors is None else ancestors
    wrap_triton(_flash_fwd_kernel)[grid](
        q, k, v, meta, meta, meta if lower is None else lower, anc, out, lse,
        scale * LOG2E,
        T, S, G,
        *q.stride(), *k.stride(), *v.stride(), *pos_strides, 0 if lower is None else lower.stride(0),
        *((0, 0, 0) if ancestors is None else anc.stride()),
        *out.stride(), *lse.stride(),
        WINDOW=window, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SCAN=scan,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DK=DK, DV=DV, HAS_LOWER=lower is not None,
        HAS_ANCESTORS=ancestors is not None, num_warps=num_warps, num_stages=num_stages, **paging,
    )
    return out, lse


@triton_op("dcp::prefix_flash_triton", mutates_args=())
def prefix_flash_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    kv_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefix_attention`` by the flash kernel: ``(out fp32 [B,Hq,T,Dv], lse fp32 [B,Hq,T])``.

    Keys ``D`` wide and values ``Dv`` wide, each at most 256, read unpadded.  ``block_m``
    (query rows a program holds: G heads x tokens) and ``block_n`` (keys per loop step),
    each one of ``BLOCK_SIZES``, override ``flash_config`` for tests and tuning.
    ``kv_start [B]``: slots ``[kv_start[b], kv_len[b])`` (a left-padding bound).
    """
    check_inputs("prefix", q, k_cache, v_cache, kv_len)
    check_lower("prefix_attention", "kv_start", kv_start, q)
    return _flash(q, k_cache, v_cache, kv_len, None, scale, block_m, block_n, kv_start)


def paged_flash(q, k_pool, v_pool, table, kv_len, scale, kv_start=None, block_m=None, block_n=None):
    """The prefix form over pools through ``table`` (checked by the caller:
    ``triton_paged.paged_prefix_attention_triton``)."""
    return _flash(q, k_pool, v_pool, kv_len, None, scale, block_m, block_n, kv_start, table=table)


@triton_op("dcp::window_flash_triton", mutates_args=())
def window_flash_triton(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    lower: torch.Tensor | None = None,
    ancestors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``window_attention`` by the flash kernel: ``(out fp32 [B,Hq,T,Dv], lse fp32 [B,Hq,T])``.

    Widths, ``block_m`` and ``block_n`` as for ``prefix_flash_triton``.  ``lower [B]``:
    keys at positions ``>= lower[b]`` only (a left-padding bound).  ``ancestors [B,T,T]``
    (bool): query ``t`` sees key ``s`` iff ``ancestors[b, t, s]``, instead of by position.
    """
    check_inputs("window", q, k_new, v_new, positions)
    check_lower("window_attention", "lower", lower, q)
    check_ancestors(ancestors, q)
    return _flash(q, k_new, v_new, None, positions, scale, block_m, block_n, lower, ancestors)


def _window_form(k_new, v_new):
    if kernel_width(k_new.shape[-1], v_new.shape[-1]) is None:
        return window_attention_reference
    return window_flash_triton


def window_attention_any_width(q, k_new, v_new, positions, scale, lower=None, ancestors=None):
    """The window kernel the registered op runs on CUDA, with the op's arguments."""
    return _window_form(k_new, v_new)(q, k_new, v_new, positions, scale, lower=lower, ancestors=ancestors)


@window_attention.register_kernel("cuda")
def _window_attention_cuda(q, k_new, v_new, positions, scale, lower=None, ancestors=None):
    return window_attention_any_width(q, k_new, v_new, positions, scale, lower, ancestors)


@window_attention.register_torch_dispatch(FunctionalTensorMode)
def _window_attention_functional(mode, op, types, args, kwargs):
    q = args[0] if args else kwargs["q"]
    k_new, v_new = (args[1], args[2]) if len(args) > 2 else (kwargs["k_new"], kwargs["v_new"])
    if not kernels_inlined() or q.device.type != "cuda" or _window_form(k_new, v_new) is window_attention_reference:
        return mode.__torch_dispatch__(op, types, args, kwargs)
    with mode:
        return window_attention_any_width(*args, **kwargs)
