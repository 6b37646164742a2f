"""The prefix kernels (``triton_prefix.py``'s split-KV, ``triton_flash.py``'s flash) reading
a paged cache through its block table: ``dcp::paged_prefix_attention`` on CUDA.

The kernels are the unpaged ones with each block's slot offsets looked up in the table
(``triton_flash.slot_rows``): one gathered load of a block's page ids, then the same K
and V loads and softmax.  The split-KV kernel cuts its slices from the table's width
(``n * P`` slots a sequence), as it cuts them from an unpaged cache's ``S``; prefill
chunks whose tiles fill the GPU go to the flash kernel, as unpaged ones do.  Registered
as ``triton_prefix.py`` registers ``prefix_attention``: eager CUDA calls through
``register_kernel``, and under ``torch.compile`` a ``FunctionalTensorMode`` rule hands
Inductor the launches."""

from __future__ import annotations

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op

from dcp_compile.ops.inlining import kernels_inlined
from dcp_compile.ops.paged import (
    check_paged, paged_latent_prefix_attention, paged_latent_prefix_attention_reference, paged_prefix_attention,
    paged_prefix_attention_reference,
)
from dcp_compile.ops.kernel_checks import SUPPORTED_DTYPES, check_index, check_lower, kernel_width
from dcp_compile.ops.triton_flash import paged_flash
from dcp_compile.ops.triton_latent import latent_kernel_fits, paged_latent_launch
from dcp_compile.ops.triton_prefix import prefix_kernel, sm_count_of, split_kv_attention


def _check_kernel_inputs(q, k_pool, v_pool, kv_len) -> None:
    """What the split-KV kernel needs beyond ``check_paged``, as ``check_inputs`` asks it of a static cache."""
    B, Hq, _, D = (int(n) for n in q.shape)
    Hkv = int(k_pool.shape[1])
    if q.dim() != 4 or int(k_pool.shape[-1]) != D or Hq % Hkv:
        raise ValueError(f"paged_prefix_attention: q {tuple(q.shape)} does not match k_pool {tuple(k_pool.shape)}: "
                         f"need q [B, Hq, T, D] with the pool's D and Hq a multiple of its Hkv")
    if kernel_width(D, int(v_pool.shape[-1])) is None:
        raise ValueError(f"the paged prefix-attention kernel takes keys and values at most 256 wide, got {D} and "
                         f"{v_pool.shape[-1]}: run dcp_compile.ops.paged_prefix_attention (the reference on CUDA)")
    if not (q.dtype == k_pool.dtype == v_pool.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the paged prefix-attention kernel takes q and the pools in one dtype among "
                        f"{SUPPORTED_DTYPES}; got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    check_index("paged_prefix_attention", "kv_len", kv_len, B, None, {"q": q, "k_pool": k_pool, "v_pool": v_pool})


@triton_op("dcp::paged_prefix_attention_triton", mutates_args=())
def paged_prefix_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    kv_start: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_s: int | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_prefix_attention`` by the Triton kernels: ``(out fp32 [B,Hq,T,Dv], lse fp32
    [B,Hq,T])``.  The kernel is the one ``prefix_kernel`` picks for the unpaged cache (the
    split-KV kernel for decode and verify steps, the flash kernel for prefill chunks that
    fill the GPU), or ``kernel`` (``"split"`` or ``"flash"``) for tests and tuning;
    ``num_splits`` and ``block_s`` tune the split-KV kernel as in ``prefix_attention_triton``."""
    check_paged(q, k_pool, v_pool, block_table, kv_len)
    _check_kernel_inputs(q, k_pool, v_pool, kv_len)
    check_lower("paged_prefix_attention", "kv_start", kv_start, q)
    page = int(k_pool.shape[2])
    if kernel not in (None, "split", "flash"):
        raise ValueError(f"kernel must be 'split', 'flash' or None (chosen by the step's shape), got {kernel!r}")
    B, Hq, T, D = (int(n) for n in q.shape)
    kernel = kernel or prefix_kernel(B, Hq, int(k_pool.shape[1]), T, kernel_width(D, int(v_pool.shape[-1])),
                                     q.element_size(), sm_count_of(q.device))
    if kernel == "flash":
        return paged_flash(q, k_pool, v_pool, block_table, kv_len, scale, kv_start)
    return split_kv_attention(q, k_pool, v_pool, kv_len, scale, int(block_table.shape[1]) * page, kv_start,
                              dict(num_splits=num_splits, block_s=block_s), table=block_table, page=page)


def _runs_on_kernel(q, k_pool, v_pool) -> bool:
    return q.device.type == "cuda" and kernel_width(int(k_pool.shape[-1]), int(v_pool.shape[-1])) is not None


@paged_prefix_attention.register_kernel("cuda")
def _paged_cuda(q, k_pool, v_pool, block_table, kv_len, scale, kv_start=None):
    if not _runs_on_kernel(q, k_pool, v_pool):  # heads wider than 256: the reference
        return paged_prefix_attention_reference(q, k_pool, v_pool, block_table, kv_len, scale, kv_start)
    return paged_prefix_attention_triton(q, k_pool, v_pool, block_table, kv_len, scale, kv_start)


@paged_prefix_attention.register_torch_dispatch(FunctionalTensorMode)
def _paged_functional(mode, op, types, args, kwargs):
    q, k_pool, v_pool = (list(args) + [kwargs.get(n) for n in ("q", "k_pool", "v_pool")][len(args):])[:3]
    if not kernels_inlined() or not _runs_on_kernel(q, k_pool, v_pool):
        return mode.__torch_dispatch__(op, types, args, kwargs)
    with mode:
        return paged_prefix_attention_triton(*args, **kwargs)


@triton_op("dcp::paged_latent_prefix_attention_triton", mutates_args=())
def paged_latent_prefix_attention_triton(
    q: torch.Tensor,
    latent_pool: torch.Tensor,
    rope_pool: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_s: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_latent_prefix_attention`` by the latent split-KV kernel (the seesaw kernel
    reads a contiguous latent through TMA and takes no table): ``(out fp32 [B, H, T, C],
    lse fp32 [B, H, T])``; ``num_splits`` and ``block_s`` as in ``latent_prefix_attention_triton``."""
    check_paged(q, latent_pool, rope_pool, block_table, kv_len)
    if not latent_kernel_fits(q, latent_pool, rope_pool) or not q.dtype == latent_pool.dtype == rope_pool.dtype:
        raise ValueError(
            f"the paged latent kernel takes q [B, H, T, C + R], latent [pages, 1, P, C] and rope [pages, 1, P, R] "
            f"pools with C and R powers of two >= 16, all in one of {SUPPORTED_DTYPES}; got {tuple(q.shape)} "
            f"{q.dtype}, {tuple(latent_pool.shape)} {latent_pool.dtype}, {tuple(rope_pool.shape)} {rope_pool.dtype}")
    check_index("paged_latent_prefix_attention", "kv_len", kv_len, int(q.shape[0]), None,
                {"q": q, "latent_pool": latent_pool, "rope_pool": rope_pool})
    return paged_latent_launch(q, latent_pool, rope_pool, block_table, kv_len, scale, num_splits,
                               dict(block_s=block_s))


def _latent_on_kernel(q, latent_pool, rope_pool) -> bool:
    return q.device.type == "cuda" and latent_kernel_fits(q, latent_pool, rope_pool)


@paged_latent_prefix_attention.register_kernel("cuda")
def _paged_latent_cuda(q, latent_pool, rope_pool, block_table, kv_len, scale):
    if not _latent_on_kernel(q, latent_pool, rope_pool):
        return paged_latent_prefix_attention_reference(q, latent_pool, rope_pool, block_table, kv_len, scale)
    return paged_latent_prefix_attention_triton(q, latent_pool, rope_pool, block_table, kv_len, scale)


@paged_latent_prefix_attention.register_torch_dispatch(FunctionalTensorMode)
def _paged_latent_functional(mode, op, types, args, kwargs):
    names = ("q", "latent_pool", "rope_pool")
    q, latent_pool, rope_pool = (list(args) + [kwargs.get(n) for n in names][len(args):])[:3]
    if not kernels_inlined() or not _latent_on_kernel(q, latent_pool, rope_pool):
        return mode.__torch_dispatch__(op, types, args, kwargs)
    with mode:
        return paged_latent_prefix_attention_triton(*args, **kwargs)
