"""Triton split-KV (flash-decoding) kernel for ``dcp::prefix_attention`` on CUDA.

The plain torch ``prefix_attention`` in ``attention.py`` stays the specification, the
CPU path and the test oracle; this module adds the GPU path beside it.

Decode and chain verifies bring a few new queries against a long local cache, so the
work is one read of K and V: the kernel is bound by HBM bandwidth, not arithmetic.
Three choices follow from that:

- One program serves a whole GQA group: the ``G`` query heads that share a KV head,
  times the ``T`` tokens, are packed into one tile of ``ROWS`` query rows (padded to a
  power of two >= 16, the smallest ``tl.dot`` tile), so each K/V block is loaded once,
  not ``G * T`` times.
- The cache length is split across programs (flash-decoding): a batch of 8 sequences
  with 8 KV heads is only 64 programs, half of the H200's 132 SMs, so each (sequence,
  KV head) is cut into ``num_splits`` slices, as many as fill one wave of the GPU
  (``split_plan``).  Each slice writes a partial ``(out, lse)``; a second small
  kernel merges the slices exactly with LSE weights (the same algebra as
  ``lse_merge``).  With one slice the first kernel writes the result directly.
- The number of slices is fixed from the capacity ``S``, never from ``kv_len``: reading
  the lengths on the host would sync the stream and break CUDA-graph capture.  Each
  program cuts its own sequence's ``kv_len`` (read on the device) into that many slices
  of whole blocks, so a sequence far shorter than the cache still spreads over every
  slice instead of leaving most of them idle.  Slices past a short sequence's length
  run no loop iteration and write ``lse = -inf``, ``out = 0``.

Tree verifies (up to ``SPLIT_KV_MAX_TOKENS`` new tokens) run the same kernel; past 64
query rows a KV head they are bound by its arithmetic.  For them a program holds
``WIDE_ROWS`` rows, and every whole block runs without masks (``_prefix_block``).

Under a left-padding mask (``kv_start``) a sequence's slots are ``[kv_start[b],
kv_len[b])`` and its slices cut that range instead.

Slots at or past ``kv_len[b]`` (or before ``kv_start[b]``) are never loaded (masked
loads), and their scores are set to ``-inf`` with ``tl.where``, so NaN or inf left in unused slots cannot leak:
``0 * NaN`` never happens.  Keys and values may be of other widths than the tile's
power of two, and of different widths (transformers' expanded MLA: 192 and 128): the
loads mask the head axis, so a decode step reads the cache as it is, with no padded copy.

**How it is registered, and why.**  ``dcp::prefix_attention`` stays an ordinary
``custom_op`` whose default kernel is the torch reference, so the CPU path and the
graphs the passes build (which name ``torch.ops.dcp.prefix_attention``) are unchanged,
and the op stays opaque on CPU.  The Triton path is a separate
``torch.library.triton_op`` (``dcp::prefix_attention_triton``), reached two ways:

- eager CUDA calls go through ``register_kernel("cuda")``;
- under ``torch.compile`` a torch-dispatch rule for ``FunctionalTensorMode`` (the mode
  AOTAutograd traces in) replaces a CUDA ``prefix_attention`` by the triton_op, which
  AOTAutograd then decomposes into its ``wrap_triton`` launches.  Inductor therefore
  sees the two kernels themselves, emits them in its own code (no Python dispatch, no
  opaque fallback node inside its CUDA graphs), and plans their buffers.

Both ways pick the kernel by its tiles against the SMs (``prefix_kernel``): this
module's ``prefix_attention_triton`` for decode and verify steps up to 128 tokens, and
for wider steps while the flash kernel's tiles would fill less than half the GPU; the
flash kernel ``prefix_flash_triton`` of ``triton_flash.py`` once they fill it (prefill
chunks).

Making ``prefix_attention`` itself the triton_op would also inline the torch reference
into every CPU graph, changing what Inductor compiles on CPU; a ``register_kernel``
alone would leave the Triton kernels hidden behind an opaque call.

MLA's latent sites have kernels of their own (``triton_latent.py``); a paged cache is read
by this kernel through its block table (``triton_paged.py``).  Under ``TRITON_INTERPRET=1``
(set before ``triton`` is imported) the kernels run on CPU tensors: so do the CI tests.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op, wrap_triton

from dcp_compile.ops.inlining import kernels_inlined
from dcp_compile.ops.attention import prefix_attention, prefix_attention_reference
from dcp_compile.ops.triton_merge import (  # noqa: F401 - the latent kernels import the merge from here
    _merge_splits, _merge_splits_kernel, _split_weights, _store_merged,
)
from dcp_compile.ops.kernel_checks import SUPPORTED_DTYPES
from dcp_compile.ops.triton_flash import (  # imports nothing of this module: no cycle
    cache_length, slot_rows, check_inputs, check_lower, flash_config, kernel_width, prefix_flash_triton,
)

MAX_ROWS = 64
"""Query rows (G * T) one program holds in a decode or chain-verify step."""
WIDE_ROWS = 128
"""Query rows one program holds once a step has more than ``MAX_ROWS`` (tree verifies):
each K/V block is then loaded once for twice the rows.  On the H200 at Hq=32, Hkv=8,
S=64K it ran 1.36-1.71x faster than 64-row blocks at every batch (1-8) and width (24-128
tokens).  It keeps the ``NUM_STAGES`` of the narrow tile: Q (32 KB at bf16 D=128) and three
stages fill 224 KB of the SM, and at batch 1 and 8, 32 and 64 tokens three stages ran
1.28-1.33x faster than two (``benchmarks/exp_prefix_variants.py`` at commit ``b3ec759``).
Only for head rows of at most ``WIDE_ROW_BYTES``; more rows are split over row blocks,
each rereading K/V (from L2 in practice)."""
WIDE_ROW_BYTES = 256
"""bf16 D <= 128, fp32 D <= 64: a 128-row fp32 accumulator stays at 64 registers a thread."""
STAGE_BYTES = 64 * 1024
"""Shared memory for one pipeline stage's K and V blocks: 128 slots of bf16 D=128.
With NUM_STAGES = 3 that is 192 KB, so one program fills an H200 SM (228 KB); the
block along S shrinks for wider heads or fp32 to stay at this size."""
NUM_STAGES = 3
NUM_WARPS = 8
MAX_SPLITS = 128
"""The merge kernel holds all of a row's splits in registers: [MAX_SPLITS, D] fp32 (8 warps past 64)."""
WIDE_HEAD_SPLITS = 64
"""The most slices planned for MLA's 512-wide latent: its kernels' measured count (the merge's tile)."""
DEFAULT_SM_COUNT = 132
"""SMs assumed when the tensors are not on a GPU (interpreter runs): the H200's."""
SPLIT_KV_MAX_TOKENS = 128
"""New tokens up to which a CUDA ``prefix_attention`` always runs this module's split-KV
kernel: decode, chain verifies and tree verifies.  On the H200 at Hq=32, Hkv=8, S=64K it
ran at least as fast as the flash kernel at every batch (1-8) and width (4-128 tokens),
1.16-1.24x faster where the flash kernel's tiles fill the GPU (batch 8 from 48 tokens,
batch 4 at 128; ``benchmarks/bench_verify_width.py``)."""
FLASH_FILL = 0.5
"""Wider steps (prefill chunks) go to the flash kernel of ``triton_flash.py`` once its
tiles (``B * Hkv * ceil(G * T / BLOCK_M)``) reach this share of the SMs, and stay on the
split-KV kernel below it.  The flash kernel does not split the cache, so with few tiles it
leaves most SMs idle and reads each KV head's whole shard on one SM: on the H200 at
Hq=32, Hkv=8, S=64K, batch 1 (8 tiles) it took 1.10-1.15 ms at every T from 4 to 128,
against 0.07-0.27 ms for the split-KV kernel."""


def prefix_kernel(batch: int, q_heads: int, kv_heads: int, tokens: int, head_dim: int, element_size: int,
                  sm_count: int) -> str:
    """``"split"`` or ``"flash"``: the prefix kernel a step of ``tokens`` new tokens per
    sequence runs (``SPLIT_KV_MAX_TOKENS``, ``FLASH_FILL``).  Shapes only, so the choice
    is fixed when a graph is traced."""
    if tokens <= SPLIT_KV_MAX_TOKENS:
        return "split"
    block_m = flash_config(head_dim, element_size, window=False)[0]
    tiles = batch * kv_heads * triton.cdiv((q_heads // kv_heads) * tokens, block_m)
    return "flash" if tiles >= FLASH_FILL * sm_count else "split"


@triton.jit
def _softmax_step(scores, live, m, l):
    """One block of the online softmax (base 2): masked scores -> ``(p, alpha, m_new,
    l_new)``.  Every block holds a live slot, so ``m`` is finite after the first and
    ``exp2(m - m_new)`` never sees -inf - -inf."""
    scores = tl.where(live[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return p, alpha, m_new, l * alpha + tl.sum(p, 1)


@triton.jit
def _masked_softmax_step(scores, visible, m, l):
    """``_softmax_step`` for a 2-D mask under which a row may see no slot of a block
    (a causal window cut into blocks): such a row keeps ``m = -inf`` and adds nothing,
    where ``exp2(-inf - -inf)`` would be NaN."""
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - shift)
    p = tl.exp2(scores - shift[:, None])
    return p, alpha, m_new, l * alpha + tl.sum(p, 1)


@triton.jit
def _split_range(kv_lo, kv_hi, num_splits, split, BLOCK_S: tl.constexpr):
    """Slots ``[lo, hi)`` of slice ``split`` of a sequence's slots ``[kv_lo, kv_hi)``: whole
    blocks, each program cutting its own sequence's range."""
    split_len = tl.cdiv(kv_hi - kv_lo, num_splits * BLOCK_S) * BLOCK_S
    lo = kv_lo + split * split_len
    return lo, tl.minimum(lo + split_len, kv_hi)


@triton.jit
def _store_partial(acc, m, l, O, LSE, o_rows, lse_rows, offs_d, row_ok):
    """``acc / l`` and the natural-log lse of one program's rows; 0 and -inf where no slot was seen."""
    seen = l > 0.0
    l_safe = tl.where(seen, l, 1.0)
    lse = tl.where(seen, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(O + o_rows[:, None] + offs_d[None, :], acc / l_safe[:, None], mask=row_ok[:, None])
    tl.store(LSE + lse_rows, lse, mask=row_ok)


@triton.jit
def _load_block(ptrs, live, cols, MASK_SLOTS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A ``[BLOCK_S, D]`` block of K or V, masked only along the axes that need it."""
    if MASK_SLOTS:
        if MASK_COLS:
            block = tl.load(ptrs, mask=live[:, None] & cols[None, :], other=0.0)
        else:
            block = tl.load(ptrs, mask=live[:, None], other=0.0)
    else:
        if MASK_COLS:
            block = tl.load(ptrs, mask=cols[None, :], other=0.0)
        else:
            block = tl.load(ptrs)
    return block


@triton.jit
def _prefix_block(q, k_base, v_base, start, hi, acc, m, l, qk_scale, offs_d, k_cols, v_cols,
                  s_ks, s_kd, s_vs, s_vd, D: tl.constexpr, BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  DK: tl.constexpr, DV: tl.constexpr, MASKED: tl.constexpr,
                  table_row, s_kp, s_vp, last_page, PAGE: tl.constexpr):
    """One block of ``BLOCK_S`` slots from ``start``: ``(acc, m, l)`` updated.  ``MASKED``
    for a block that may pass ``hi``.  ``PAGE`` > 0: K and V are pools of pages (``slot_rows``)."""
    offs_s = start + tl.arange(0, BLOCK_S)
    live = offs_s < hi
    k_rows, v_rows = slot_rows(table_row, offs_s, live, s_kp, s_ks, s_vp, s_vs, last_page, PAGE, MASKED)
    return _block_at(q, k_base, v_base, k_rows, v_rows, live, acc, m, l, qk_scale, offs_d, k_cols, v_cols, s_kd,
                     s_vd, D, DOT_PRECISION, DK, DV, MASKED)


@triton.jit
def _block_at(q, k_base, v_base, k_rows, v_rows, live, acc, m, l, qk_scale, offs_d, k_cols, v_cols, s_kd, s_vd,
              D: tl.constexpr, DOT_PRECISION: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, MASKED: tl.constexpr):
    """The block at slot offsets ``k_rows`` / ``v_rows``: ``(acc, m, l)`` updated.  The scale
    enters the online softmax as one multiply-add per score (``max(s) * c == max(s * c)``
    for ``c > 0``), as in FlashAttention-2."""
    k = _load_block(k_base + k_rows[:, None] + offs_d[None, :] * s_kd, live, k_cols, MASKED, DK != D)
    v = _load_block(v_base + v_rows[:, None] + offs_d[None, :] * s_vd, live, v_cols, MASKED, DV != D)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32)
    if MASKED:
        scores = tl.where(live[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1) * qk_scale)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores * qk_scale - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l * alpha + tl.sum(p, 1)


@triton.jit
def _prefix_split_kernel(
    Q, K, V, KV_LEN, KV_START, O, LSE,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    S, T, G, num_splits,
    s_qb, s_qh, s_qt, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_ob, s_oh, s_ot, s_os,
    s_lb, s_lh, s_lt, s_ls,
    ROWS: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, HAS_START: tl.constexpr,
    TABLE, s_tb, last_page, PAGE: tl.constexpr, PREFETCH: tl.constexpr,
):
    # D is the tile's head width, a power of two; the keys are DK wide and the values DV
    # (transformers' expanded MLA: 192 and 128), read unpadded under a mask on the head
    # axis.  The masks on q and v keep each load inside its row: what they keep out could
    # only reach key columns that are zero or output columns past DV, which the wrapper
    # cuts off.  The output has D columns.
    split = tl.program_id(0)
    row_blocks = tl.cdiv(G * T, ROWS)
    kv_head = tl.program_id(1) // row_blocks
    row_block = tl.program_id(1) % row_blocks
    b = tl.program_id(2).to(tl.int64)  # b * batch stride can pass 2**31 elements

    # Row r of the tile is query head kv_head * G + r // T, token r % T.
    rows = row_block * ROWS + tl.arange(0, ROWS)
    row_ok = rows < G * T
    head = (kv_head * G + rows // T).to(tl.int64)
    tok = rows % T
    offs_d = tl.arange(0, D)
    k_cols = offs_d < DK
    v_cols = offs_d < DV
    q = tl.load(
        Q + b * s_qb + head[:, None] * s_qh + tok[:, None] * s_qt + offs_d[None, :] * s_qd,
        mask=row_ok[:, None] & k_cols[None, :], other=0.0,
    )

    kv_hi = cache_length(KV_LEN, b, S)
    kv_lo = tl.full([], 0, tl.int32)
    if HAS_START:
        kv_lo = tl.minimum(tl.maximum(tl.load(KV_START + b), 0), kv_hi).to(tl.int32)
    lo, hi = _split_range(kv_lo, kv_hi, num_splits, split, BLOCK_S)
    # Paged (PAGE > 0): K and V are [pages, Hkv, PAGE, D] pools, their first stride a page's,
    # and row b of TABLE names the pages of sequence b's slots in order.
    k_base = K + kv_head.to(tl.int64) * s_kh
    v_base = V + kv_head.to(tl.int64) * s_vh
    table_row = TABLE
    if PAGE == 0:
        k_base += b * s_kb
        v_base += b * s_vb
    else:
        table_row += b * s_tb

    m = tl.full([ROWS], float("-inf"), tl.float32)  # running max of the base-2 scores
    l = tl.zeros([ROWS], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([ROWS, D], tl.float32)
    # The cast pins fp32 where a caller (Inductor) passes qk_scale as an fp64 scalar.
    qk_scale = tl.cast(qk_scale, tl.float32)
    # Whole blocks run without masks (a wide verify step is bound by this loop's
    # arithmetic); only a slice's last, partial block pays for them.
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_S * BLOCK_S
    if PAGE > 0 and PREFETCH:  # page ids read a block ahead: no K or V load waits on a load of its iteration
        offs = tl.arange(0, BLOCK_S)
        k_rows, v_rows = slot_rows(table_row, lo + offs, lo + offs < full_hi, s_kb, s_ks, s_vb, s_vs, last_page,
                                   PAGE, True)
        for start in range(lo, full_hi, BLOCK_S):
            ahead = start + BLOCK_S + offs
            k_next, v_next = slot_rows(table_row, ahead, ahead < full_hi, s_kb, s_ks, s_vb, s_vs, last_page, PAGE,
                                       True)
            acc, m, l = _block_at(q, k_base, v_base, k_rows, v_rows, offs >= 0, acc, m, l, qk_scale, offs_d, k_cols,
                                  v_cols, s_kd, s_vd, D, DOT_PRECISION, DK, DV, False)
            k_rows, v_rows = k_next, v_next
    else:
        for start in range(lo, full_hi, BLOCK_S):
            acc, m, l = _prefix_block(q, k_base, v_base, start, hi, acc, m, l, qk_scale, offs_d, k_cols, v_cols,
                                      s_ks, s_kd, s_vs, s_vd, D, BLOCK_S, DOT_PRECISION, DK, DV, False,
                                      table_row, s_kb, s_vb, last_page, PAGE)
    if full_hi < hi:
        acc, m, l = _prefix_block(q, k_base, v_base, full_hi, hi, acc, m, l, qk_scale, offs_d, k_cols, v_cols,
                                  s_ks, s_kd, s_vs, s_vd, D, BLOCK_S, DOT_PRECISION, DK, DV, True,
                                  table_row, s_kb, s_vb, last_page, PAGE)

    _store_partial(acc, m, l, O, LSE, b * s_ob + head * s_oh + tok * s_ot + split * s_os,
                   b * s_lb + head * s_lh + tok * s_lt + split * s_ls, offs_d, row_ok)


def default_block_s(head_dim: int, element_size: int) -> int:
    """Slots per loop step: 128, or fewer where one stage would pass ``STAGE_BYTES``."""
    return min(128, STAGE_BYTES // (2 * head_dim * element_size))


def split_plan(
    batch: int, kv_heads: int, row_blocks: int, capacity: int, block_s: int, sm_count: int,
    most: int = MAX_SPLITS,
) -> tuple[int, int]:
    """``(num_splits, split_len)`` for a cache of ``capacity`` slots.

    One program fills an SM (``STAGE_BYTES``), so the grid is sized to one full wave:
    ``sm_count // programs`` slices, never more programs than SMs, and a grid that
    already has more programs than SMs is not split.  On the H200 at Hkv=8, D=128 that
    is 16 slices at B=1, 2 at B=8 and 1 at B=64.  Sweeps there put a partial second
    wave at up to 15% below a full one, and more, shorter slices did no better.
    """
    blocks = triton.cdiv(max(capacity, 1), block_s)
    wanted = max(1, sm_count // (batch * kv_heads * row_blocks))
    return _splits_of(blocks, min(wanted, most), block_s)


def _splits_of(blocks: int, num_splits: int, block_s: int) -> tuple[int, int]:
    # Round the slice up to whole blocks, then drop the slices that would start past S.
    split_blocks = triton.cdiv(blocks, max(1, min(num_splits, blocks)))
    return triton.cdiv(blocks, split_blocks), split_blocks * block_s


def sm_count_of(device: torch.device) -> int:
    """The SMs of a CUDA device; ``DEFAULT_SM_COUNT`` for CPU tensors (interpreter runs)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SM_COUNT


def _num_splits(q: torch.Tensor, kv_heads: int, row_blocks: int, capacity: int, block_s: int,
                num_splits: int | None, most: int = MAX_SPLITS) -> int:
    """Slices per sequence (and KV head): ``split_plan``'s (at most ``most``), or the caller's, checked."""
    B = int(q.shape[0])
    if num_splits is None:
        return split_plan(B, kv_heads, row_blocks, capacity, block_s, sm_count_of(q.device), most)[0]
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must lie in [1, {MAX_SPLITS}], got {num_splits}")
    return _splits_of(triton.cdiv(max(capacity, 1), block_s), num_splits, block_s)[0]


def _split_outputs(q: torch.Tensor, width: int, num_splits: int):
    """``(out [B, H, T, width], lse [B, H, T], o_part, lse_part, o_strides, l_strides)``: with
    one slice the split kernel writes the result itself (split stride 0); with more it
    writes per-slice partials that ``_merge_splits`` folds into ``out`` and ``lse``."""
    B, H, T = (int(n) for n in q.shape[:3])
    out = torch.empty((B, H, T, width), device=q.device, dtype=torch.float32)
    lse = torch.empty((B, H, T), device=q.device, dtype=torch.float32)
    if num_splits == 1:
        return out, lse, out, lse, (*out.stride()[:3], 0), (*lse.stride(), 0)
    o_part = torch.empty((B, H, T, num_splits, width), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((B, H, T, num_splits), device=q.device, dtype=torch.float32)
    return out, lse, o_part, lse_part, o_part.stride()[:4], lse_part.stride()


def _tiles(q: torch.Tensor, D: int, rows_needed: int, block_s: int | None, rows: int | None) -> tuple[int, int]:
    """``(block_s, rows)`` of a split-KV launch: the caller's, checked, or the defaults
    (``default_block_s``; ``WIDE_ROWS`` past ``MAX_ROWS`` query rows a KV head)."""
    if block_s is None:
        block_s = default_block_s(D, q.element_size())
    elif block_s not in (16, 32, 64, 128) or block_s > default_block_s(D, q.element_size()):
        raise ValueError(
            f"block_s must be one of 16, 32, 64, 128 and at most {default_block_s(D, q.element_size())} for "
            f"D={D} in {q.dtype}, got {block_s}"
        )
    if rows is not None and rows not in (16, 32, 64, 128):
        raise ValueError(f"rows must be one of 16, 32, 64, 128, got {rows}")
    if rows is None:
        rows = WIDE_ROWS if rows_needed > MAX_ROWS and D * q.element_size() <= WIDE_ROW_BYTES else MAX_ROWS
    return block_s, min(rows, max(16, triton.next_power_of_2(rows_needed)))


@triton_op("dcp::prefix_attention_triton", mutates_args=())
def prefix_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_s: int | None = None,
    kv_start: torch.Tensor | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefix_attention`` by the Triton kernels: ``(out fp32 [B,Hq,T,Dv], lse fp32 [B,Hq,T])``.

    Keys (and q) ``D`` wide and values ``Dv`` wide, each at most 256 and neither
    necessarily a power of two: the split-KV kernel reads them unpadded, masking its
    tile's head axis (``kernel_width``) past each.  ``num_splits`` (slices of the cache
    per sequence and KV head, at most ``MAX_SPLITS``) and ``block_s`` (slots per loop
    step: 16, 32, 64 or 128) override ``split_plan`` and ``default_block_s``, for tests
    and tuning.  ``kv_start [B]``: slots ``[kv_start[b], kv_len[b])`` (a left-padding bound).
    ``rows`` (query rows a program holds: 16, 32, 64 or 128) overrides ``MAX_ROWS`` /
    ``WIDE_ROWS``, for tests and tuning.
    ``num_warps`` and ``num_stages`` override ``NUM_WARPS`` and those stages, for tuning.
    """
    check_inputs("prefix", q, k_cache, v_cache, kv_len, kernel="prefix-attention")
    check_lower("prefix_attention", "kv_start", kv_start, q)
    return split_kv_attention(q, k_cache, v_cache, kv_len, scale, int(k_cache.shape[2]), kv_start,
                              dict(num_splits=num_splits, block_s=block_s, rows=rows, num_warps=num_warps,
                                   num_stages=num_stages))


def split_kv_attention(q, k, v, kv_len, scale, S, kv_start=None, tuning=None, table=None, page=0):
    """The split-KV launch and its merge over ``S`` slots a sequence, of a ``[B, Hkv, S, D]``
    cache, or (``page`` > 0) of ``[pages, Hkv, page, D]`` pools through ``table [B, S / page]``.
    ``tuning``: ``prefix_attention_triton``'s overrides (``None`` each for the defaults)."""
    tuning = tuning or {}
    # Shapes fix the grid and the tile sizes: a graph traced with symbolic sizes
    # specializes on them here.
    B, Hq, T, DK = (int(n) for n in q.shape)
    Hkv, DV = int(k.shape[1]), int(v.shape[3])
    D = kernel_width(DK, DV)
    G = Hq // Hkv
    block_s, rows = _tiles(q, D, G * T, tuning.get("block_s"), tuning.get("rows"))
    row_blocks = triton.cdiv(G * T, rows)
    num_splits = _num_splits(q, Hkv, row_blocks, S, block_s, tuning.get("num_splits"))
    out, lse, o_part, lse_part, o_strides, l_strides = _split_outputs(q, D, num_splits)
    # Unpaged launches pass the table's arguments too (never read): Inductor's wrapper of the kernel takes them all.
    paging = dict(TABLE=kv_len, s_tb=0, last_page=0, PAGE=0, PREFETCH=False) if not page else dict(
        TABLE=table, s_tb=table.stride(0), last_page=int(k.shape[0]) - 1, PAGE=page,
        PREFETCH=tuning.get("prefetch", True))
    wrap_triton(_prefix_split_kernel)[(num_splits, Hkv * row_blocks, B)](
        q, k, v, kv_len, kv_len if kv_start is None else kv_start, o_part, lse_part,
        scale * 1.4426950408889634,
        S, T, G, num_splits,
        *q.stride(), *k.stride(), *v.stride(), *o_strides, *l_strides,
        ROWS=rows, D=D, BLOCK_S=block_s, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DK=DK, DV=DV, HAS_START=kv_start is not None, num_warps=tuning.get("num_warps") or NUM_WARPS,
        num_stages=tuning.get("num_stages") or NUM_STAGES, **paging,
    )
    _merge_splits(o_part, lse_part, out, lse, num_splits)
    # A step's output (a few hundred rows at most: wider steps fill the GPU and go to the
    # flash kernel) is small next to the cache.
    return (out if DV == D else out[..., :DV].contiguous()), lse


def _kernel_for(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The split-KV kernel for decode and verify steps, and while a wider step's flash
    tiles would leave the GPU half idle; the flash kernel once they fill it (prefill
    chunks): ``prefix_kernel``."""
    B, Hq, T = (int(n) for n in q.shape[:3])
    width = kernel_width(int(k_cache.shape[-1]), int(v_cache.shape[-1]))
    choice = prefix_kernel(B, Hq, int(k_cache.shape[1]), T, width, q.element_size(), sm_count_of(q.device))
    return prefix_attention_triton if choice == "split" else prefix_flash_triton


def prefix_attention_any_width(q, k_cache, v_cache, kv_len, scale, kv_start=None):
    """The prefix kernel the registered op runs on CUDA (``_kernel_for``), for keys and
    values of any widths up to 256."""
    return _kernel_for(q, k_cache, v_cache)(q, k_cache, v_cache, kv_len, scale, kv_start=kv_start)


def _cuda_form(q, k_cache, v_cache):
    """Keys and values wider than 256 run the reference (MLA's latent form, keys 576
    wide, has kernels of its own: ``dcp::latent_prefix_attention``)."""
    if kernel_width(k_cache.shape[-1], v_cache.shape[-1]) is None:
        return prefix_attention_reference
    return prefix_attention_any_width


@prefix_attention.register_kernel("cuda")
def _prefix_attention_cuda(q, k_cache, v_cache, kv_len, scale, kv_start=None):
    return _cuda_form(q, k_cache, v_cache)(q, k_cache, v_cache, kv_len, scale, kv_start)


@prefix_attention.register_torch_dispatch(FunctionalTensorMode)
def _prefix_attention_functional(mode, op, types, args, kwargs):
    q = args[0] if args else kwargs["q"]
    k_cache, v_cache = (args[1], args[2]) if len(args) > 2 else (kwargs["k_cache"], kwargs["v_cache"])
    if (not kernels_inlined() or q.device.type != "cuda"
            or _cuda_form(q, k_cache, v_cache) is prefix_attention_reference):
        # Kept as one opaque op: the reference reads kv_len's largest value, which a
        # traced graph cannot.
        return mode.__torch_dispatch__(op, types, args, kwargs)
    with mode:
        return prefix_attention_any_width(*args, **kwargs)
