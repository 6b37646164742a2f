"""Triton kernels for MLA's latent sites: ``dcp::latent_prefix_attention`` and
``dcp::latent_window_attention`` on CUDA.

``_latent_split_kernel`` holds one latent head ``[latent | rope key]`` whose latent is also
the value, so every query head of a sequence shares each slot's load.  It serves
``dcp::latent_prefix_attention`` (the shard's slots, split across programs like the GQA
kernel of ``triton_prefix.py``, whose softmax steps, slicing and merge it shares) and, in
its causal form, ``dcp::latent_window_attention`` (the new tokens), for any number of new
tokens: at decode a program holds all heads of a sequence, for a prefill chunk 64
consecutive tokens of one head.  Where compute binds (64 or more query rows a sequence, on
Hopper) the prefix goes to the Gluon kernel of ``gluon_latent.py`` instead
(``latent_prefix_kernel``), an opaque op of its own.  The ops are registered as
``triton_prefix.py`` explains for the GQA prefix: the torch reference stays the op's
default kernel, CUDA calls and ``torch.compile`` reach the triton_ops.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
import triton
import triton.language as tl
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op, wrap_triton

from dcp_compile.ops.inlining import kernels_inlined
from dcp_compile.ops.attention import (
    latent_prefix_attention, latent_prefix_attention_reference, latent_window_attention,
    latent_window_attention_reference,
)
from dcp_compile.ops.triton_flash import cache_length, check_index, scan_block, slot_rows, window_bounds
from dcp_compile.ops.triton_prefix import (
    MAX_ROWS, SUPPORTED_DTYPES, WIDE_HEAD_SPLITS, _masked_softmax_step, _merge_splits, _num_splits, _softmax_step,
    _split_outputs, _split_range, _store_partial,
)

try:  # Gluon (Triton 3.5 and later): the compute-bound prefix on Hopper; without it the split-KV kernel serves all
    from dcp_compile.ops import gluon_latent
except ImportError:
    gluon_latent = None


@triton.jit
def _latent_split_kernel(
    Q, KV, PE, KV_LEN, POS, O, LSE,
    qk_scale,  # softmax scale * log2(e)
    S, T, H, num_splits,
    s_qb, s_qh, s_qt, s_qd,
    s_cb, s_cs, s_cd,
    s_pb, s_ps, s_pd,
    s_posb, s_post,
    s_ob, s_oh, s_ot, s_os,
    s_lb, s_lh, s_lt, s_ls,
    ROWS: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr, SCAN: tl.constexpr, TABLE, s_tb, last_page, PAGE: tl.constexpr,
):
    """MLA's prefix: every query head against one latent head.  Scores add ``q[:C] .
    latent`` and ``q[C:] . rope_key``; the values are the latent tile already loaded for
    the scores, so each slot's ``C + R`` numbers are read once.

    ``CAUSAL``: MLA's window instead, the ``S = T`` new tokens as keys, key ``s`` seen by
    token ``t`` where ``POS[b, s] <= POS[b, t]``; ``KV_LEN`` is not read.  Positions may
    come in any order, so a row may see nothing in a block: the masked softmax step; the
    loop ends at the last key any row of the tile sees (``window_bounds``), which for a
    chunk in order halves the work.

    Rows are (head, token) pairs, ``ROWS`` of them a program: at decode all heads of a
    sequence share each load; for a prefill chunk of ``T`` tokens a program holds
    ``ROWS`` consecutive tokens of one head, a flash-attention tile.

    ``PAGE`` > 0 (the prefix only): the latent and rope key are ``[pages, 1, PAGE, .]``
    pools, their first stride a page's, read through row ``b`` of ``TABLE`` (``slot_rows``)."""
    split = tl.program_id(0)
    row_block = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)

    rows = row_block * ROWS + tl.arange(0, ROWS)
    row_ok = rows < H * T
    head = (rows // T).to(tl.int64)
    tok = rows % T
    offs_c = tl.arange(0, C)
    offs_r = tl.arange(0, R)
    q_rows = Q + b * s_qb + head[:, None] * s_qh + tok[:, None] * s_qt
    q_lat = tl.load(q_rows + offs_c[None, :] * s_qd, mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_rows + (C + offs_r[None, :]) * s_qd, mask=row_ok[:, None], other=0.0)

    if CAUSAL:  # one slice (num_splits = 1), over the keys some row of the tile sees
        q_pos = tl.load(POS + b * s_posb + tok * s_post, mask=row_ok, other=0)  # padding rows are not stored
        _, hi = window_bounds(POS + b * s_posb, s_post, S, tl.min(q_pos, 0), tl.max(q_pos, 0), SCAN)
        lo = 0
    else:
        lo, hi = _split_range(0, cache_length(KV_LEN, b, S), num_splits, split, BLOCK_S)
    kv_base = KV
    pe_base = PE
    if PAGE == 0:
        kv_base += b * s_cb
        pe_base += b * s_pb
    else:
        table_row = TABLE + b * s_tb

    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, C], tl.float32)
    for start in range(lo, hi, BLOCK_S):
        offs_s = start + tl.arange(0, BLOCK_S)
        live = offs_s < hi
        if PAGE == 0:
            kv_rows = offs_s * s_cs
            pe_rows = offs_s * s_ps
        else:
            kv_rows, pe_rows = slot_rows(table_row, offs_s, live, s_cb, s_cs, s_pb, s_ps, last_page, PAGE, True)
        kv = tl.load(kv_base + kv_rows[:, None] + offs_c[None, :] * s_cd, mask=live[:, None], other=0.0)
        pe = tl.load(pe_base + pe_rows[:, None] + offs_r[None, :] * s_pd, mask=live[:, None], other=0.0)
        scores = tl.dot(q_lat, tl.trans(kv), input_precision=DOT_PRECISION)
        scores = scores + tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
        scores = (scores * qk_scale).to(tl.float32)
        if CAUSAL:
            k_pos = tl.load(POS + b * s_posb + offs_s * s_post, mask=live, other=0)
            visible = live[None, :] & (k_pos[None, :] <= q_pos[:, None])
            p, alpha, m, l = _masked_softmax_step(scores, visible, m, l)
        else:
            p, alpha, m, l = _softmax_step(scores, live, m, l)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)

    _store_partial(acc, m, l, O, LSE, b * s_ob + head * s_oh + tok * s_ot + split * s_os,
                   b * s_lb + head * s_lh + tok * s_lt + split * s_ls, offs_c, row_ok)


MAX_GRID_Y = 65535
"""CUDA's limit on the grid's second axis, which counts the latent kernel's row blocks."""


def latent_kernel_fits(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> bool:
    """Whether the latent kernel takes these shapes: power-of-two latent and rope widths
    of at least 16 (``tl.dot``'s smallest), one cache head, a dtype the kernel loads,
    and at most ``MAX_GRID_Y`` blocks of ``MAX_ROWS`` query rows (heads x tokens)."""
    C, R = int(latent.shape[-1]), int(rope.shape[-1])
    return (
        latent.shape[1] == 1 and rope.shape[1] == 1 and q.shape[-1] == C + R and q.dtype in SUPPORTED_DTYPES
        and all(w >= 16 and w & (w - 1) == 0 for w in (C, R))
        and triton.cdiv(int(q.shape[1]) * int(q.shape[2]), MAX_ROWS) <= MAX_GRID_Y
    )


LATENT_TILE_CHOICES = MappingProxyType(
    dict(rows=(16, 32, 64), block_s=(16, 32, 64, 128), num_warps=(4, 8, 16), num_stages=(1, 2, 3, 4))
)
"""What the latent kernel's wrappers accept as tile overrides (the sweep in
``benchmarks/bench_latent_kernel.py`` tries these)."""
LATENT_STAGE_BYTES = 64 * (512 + 64) * 2
"""One pipeline stage of the latent kernel: 64 slots of DeepSeek's bf16 latent + rope key."""


def latent_tiles(rows_wanted: int, width: int, element_size: int) -> dict:
    """The latent kernel's default tiles for ``rows_wanted = H * T`` query rows over
    ``width = C + R`` numbers a slot: ``rows`` (query rows a program holds), ``block_s``
    (slots a loop step), ``num_warps`` and ``num_stages``.

    From the sweep on an H200 (bf16, C=512, R=64, ``bench_latent_kernel.py --sweep``,
    BENCHMARKS.md): 16 rows (decode, H=16) are memory-bound and want loads in flight,
    4 warps and 3 stages of 64 slots (3.81 TB/s against 1.73 for 8 warps and 2 stages
    of 32); 64 rows (H=128, or H=16 x T=4) hold a 64 x 512 fp32 accumulator, so 8 warps
    and 2 stages of 64 slots (268 TFLOP/s against 182; 16 warps and 128-slot blocks did
    worse).  32 rows take the 16-row tiles (the best 32-row choice at H=16, T=4).  Wider
    slots or fp32 shrink ``block_s`` to keep a stage within ``LATENT_STAGE_BYTES``."""
    rows = min(MAX_ROWS, max(16, triton.next_power_of_2(rows_wanted)))
    fit = max(16, min(64, LATENT_STAGE_BYTES // (width * element_size)))
    warps, stages = (4, 3) if rows <= 32 else (8, 2)
    return dict(rows=rows, block_s=1 << (fit.bit_length() - 1), num_warps=warps, num_stages=stages)


def check_latent_inputs(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, kv_len, positions) -> None:
    """Refuse what the latent kernel cannot run (a batch, dtype or device that disagrees,
    a length tensor of another shape), saying what it expected, what it got and the fix:
    the kernel itself would read past a tensor or fail to compile."""
    window = positions is not None
    name, extra = ("positions", positions) if window else ("kv_len", kv_len)
    if q.dim() != 4 or latent.dim() != 4 or rope.dim() != 4:
        raise ValueError(f"the latent kernel takes 4-D q, latent and rope; got {tuple(q.shape)}, "
                         f"{tuple(latent.shape)}, {tuple(rope.shape)}")
    B, _, T, _ = q.shape
    if latent.shape[0] != B or rope.shape[0] != B or latent.shape[2] != rope.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)}, latent {tuple(latent.shape)} and rope {tuple(rope.shape)} must share the batch B "
            f"(dim 0), and latent and rope the slots (dim 2)"
        )
    if window and latent.shape[2] != T:
        raise ValueError(
            f"the latent window takes T new tokens in q [B, H, T, .], latent [B, 1, T, C] and positions [B, T]; got "
            f"{tuple(q.shape)}, {tuple(latent.shape)}, {tuple(positions.shape)}"
        )
    if not (q.dtype == latent.dtype == rope.dtype):
        raise TypeError(f"the latent kernel takes q, latent and rope of one dtype; got {q.dtype}, {latent.dtype}, "
                        f"{rope.dtype}: cast them to one of {SUPPORTED_DTYPES}")
    check_index("the latent kernel", name, extra, B, T if window else None, {"q": q, "latent": latent, "rope": rope})


def latent_prefix_kernel(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, overrides: dict) -> str:
    """``"seesaw"`` (``gluon_latent.py``) where compute binds: 64 or more query rows
    (``H * T``) a sequence on Hopper, in the shapes that kernel takes; ``"split"`` (this
    module's split-KV kernel) otherwise, and whenever a tile override asks for it.  On an
    H200 the seesaw kernel ran 391-574 TFLOP/s where the split-KV kernel ran 221-285
    (H=128 x T=1 and H=16 x T=4..16, 8K-32K slots)."""
    if gluon_latent is None or any(v is not None for v in overrides.values()):
        return "split"
    return "seesaw" if gluon_latent.gluon_latent_fits(q, latent, rope) else "split"


def _latent_launch(q, latent, rope, kv_len, positions, scale, num_splits, overrides: dict, table=None):
    """Both latent kernels: the prefix (``kv_len``) or the causal window (``positions``);
    ``table``: the prefix over ``[pages, 1, P, .]`` pools through a block table ``[B, n]``
    (checked by the caller), on the split-KV kernel."""
    if table is None:
        check_latent_inputs(q, latent, rope, kv_len, positions)
    if not latent_kernel_fits(q, latent, rope):
        raise ValueError(
            f"the latent kernel takes q [B, H, T, C + R] with H * T <= {MAX_GRID_Y * MAX_ROWS}, latent [B, 1, S, C] "
            f"and rope [B, 1, S, R] with C and R powers of two >= 16 in {SUPPORTED_DTYPES}; got {tuple(q.shape)}, "
            f"{tuple(latent.shape)}, {tuple(rope.shape)}, {q.dtype} (a prefill chunk this large: use smaller chunks)"
        )
    if positions is None and table is None and latent_prefix_kernel(q, latent, rope, overrides) == "seesaw":
        return torch.ops.dcp.latent_prefix_attention_gluon(q, latent, rope, kv_len, scale, num_splits)
    B, H, T, _ = (int(n) for n in q.shape)
    S, C, R = int(latent.shape[2]), int(latent.shape[3]), int(rope.shape[3])
    # Unpaged launches pass the table's arguments too (never read): Inductor's wrapper of
    # the kernel takes every argument, defaults included.
    index = positions if positions is not None else kv_len
    paging = dict(TABLE=index, s_tb=0, last_page=0, PAGE=0) if table is None else dict(
        TABLE=table, s_tb=table.stride(0), last_page=int(latent.shape[0]) - 1, PAGE=S)
    S = S if table is None else int(table.shape[1]) * S
    tiles = latent_tiles(H * T, C + R, q.element_size())
    for name, value in overrides.items():
        if value is not None:
            if value not in LATENT_TILE_CHOICES[name]:
                raise ValueError(f"{name} must be one of {LATENT_TILE_CHOICES[name]}, got {value}")
            tiles[name] = value
    causal = positions is not None
    if causal:  # the window is short next to a prefix: its rows' blocks fill the GPU unsplit
        num_splits = 1
    row_blocks = triton.cdiv(H * T, tiles["rows"])
    if row_blocks > MAX_GRID_Y:
        raise ValueError(f"{H} heads x {T} tokens make {row_blocks} blocks of rows={tiles['rows']}, more than the "
                         f"grid's {MAX_GRID_Y}: take more rows a block, or prefill in smaller chunks")
    num_splits = _num_splits(q, 1, row_blocks, S, tiles["block_s"], num_splits, most=WIDE_HEAD_SPLITS)
    out, lse, o_part, lse_part, o_strides, l_strides = _split_outputs(q, C, num_splits)
    index = positions if causal else kv_len
    wrap_triton(_latent_split_kernel)[(num_splits, row_blocks, B)](
        q, latent, rope, index, index, o_part, lse_part,
        scale * 1.4426950408889634,
        S, T, H, num_splits,
        *q.stride(), latent.stride(0), latent.stride(2), latent.stride(3), rope.stride(0), rope.stride(2),
        rope.stride(3), *(positions.stride() if causal else (0, 0)), *o_strides, *l_strides,
        ROWS=tiles["rows"], C=C, R=R, BLOCK_S=tiles["block_s"],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", CAUSAL=causal,
        SCAN=scan_block(S, causal),
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"], **paging,
    )
    _merge_splits(o_part, lse_part, out, lse, num_splits)
    return out, lse


@triton_op("dcp::latent_prefix_attention_triton", mutates_args=())
def latent_prefix_attention_triton(
    q: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_s: int | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``latent_prefix_attention`` by the Triton kernels: ``q [B, H, T, C + R]`` over
    ``latent [B, 1, S, C]`` and ``rope [B, 1, S, R]``; ``(out fp32 [B, H, T, C], lse fp32
    [B, H, T])``.  ``latent_prefix_kernel`` picks the kernel.  ``num_splits`` as for
    ``prefix_attention_triton``; ``block_s``, ``rows``, ``num_warps`` and ``num_stages``
    override ``latent_tiles`` (values from ``LATENT_TILE_CHOICES``) and so take the
    split-KV kernel, for tests and tuning."""
    return _latent_launch(q, latent, rope, kv_len, None, scale, num_splits,
                          dict(block_s=block_s, rows=rows, num_warps=num_warps, num_stages=num_stages))


@triton_op("dcp::latent_window_attention_triton", mutates_args=())
def latent_window_attention_triton(
    q: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    block_s: int | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``latent_window_attention`` by the latent kernel: ``q [B, H, T, C + R]`` over the
    new tokens' ``latent [B, 1, T, C]`` and ``rope [B, 1, T, R]``, causal by ``positions
    [B, T]``; ``(out fp32 [B, H, T, C], lse fp32 [B, H, T])``.  Tile overrides as for
    ``latent_prefix_attention_triton``."""
    return _latent_launch(q, latent, rope, None, positions, scale, None,
                          dict(block_s=block_s, rows=rows, num_warps=num_warps, num_stages=num_stages))


def _register_latent(op, reference, kernel) -> None:
    """CUDA calls of a latent op run its Triton kernel where the shapes fit (eagerly, and
    inlined by Inductor through the functional dispatch), the reference otherwise."""

    @op.register_kernel("cuda")
    def _cuda(q, latent, rope, index, scale):
        if latent_kernel_fits(q, latent, rope):
            return kernel(q, latent, rope, index, scale)
        return reference(q, latent, rope, index, scale)

    @op.register_torch_dispatch(FunctionalTensorMode)
    def _functional(mode, op_, types, args, kwargs):
        q, latent, rope = (args[:3] if len(args) >= 3 else (kwargs["q"], kwargs["latent"], kwargs["rope"]))
        if not kernels_inlined() or q.device.type != "cuda" or not latent_kernel_fits(q, latent, rope):
            return mode.__torch_dispatch__(op_, types, args, kwargs)
        with mode:
            return kernel(*args, **kwargs)


_register_latent(latent_prefix_attention, latent_prefix_attention_reference, latent_prefix_attention_triton)
_register_latent(latent_window_attention, latent_window_attention_reference, latent_window_attention_triton)


def paged_latent_launch(q, latent_pool, rope_pool, table, kv_len, scale, num_splits=None, overrides=None):
    """The latent prefix over pools through ``table``, on the split-KV kernel (checked by
    the caller: ``triton_paged.paged_latent_prefix_attention_triton``)."""
    return _latent_launch(q, latent_pool, rope_pool, kv_len, None, scale, num_splits, overrides or {}, table=table)
