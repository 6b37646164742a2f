"""The split-KV kernel of ``triton_prefix.py`` reading a paged cache through its block
table: ``dcp::paged_prefix_attention`` on CUDA.

The kernel is the unpaged one with each block's slot offsets looked up in the table
(``_slot_rows``): one gathered load of ``BLOCK_S`` page ids a block, then the same K and
V loads, softmax and merge.  Slices are cut from the table's width (``n * P`` slots a
sequence), as the unpaged kernel cuts them from the cache's ``S``.  Registered as that
module registers ``prefix_attention``: eager CUDA calls through ``register_kernel``, and
under ``torch.compile`` a ``FunctionalTensorMode`` rule hands Inductor the launches."""

from __future__ import annotations

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op

from dcp_compile.ops.inlining import kernels_inlined
from dcp_compile.ops.paged import check_paged, paged_prefix_attention, paged_prefix_attention_reference
from dcp_compile.ops.triton_flash import check_index, check_lower, kernel_width
from dcp_compile.ops.triton_prefix import SUPPORTED_DTYPES, split_kv_attention


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_prefix_attention`` by the split-KV kernel: ``(out fp32 [B,Hq,T,Dv], lse fp32
    [B,Hq,T])``; ``num_splits`` and ``block_s`` as in ``prefix_attention_triton``."""
    check_paged(q, k_pool, v_pool, block_table, kv_len)
    _check_kernel_inputs(q, k_pool, v_pool, kv_len)
    check_lower("paged_prefix_attention", "kv_start", kv_start, q)
    S = int(block_table.shape[1]) * int(k_pool.shape[2])
    return split_kv_attention(q, k_pool, v_pool, kv_len, scale, S, kv_start,
                              dict(num_splits=num_splits, block_s=block_s), table=block_table,
                              page=int(k_pool.shape[2]))


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
