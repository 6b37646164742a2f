"""Ops the passes insert: reference implementations first (plain torch, fp32 math),
Triton kernels beside them (registered for CUDA tensors on import)."""

from dcp_compile.ops.attention import (
    attention_with_lse, blocked_attention, latent_prefix_attention, latent_window_attention, prefix_attention,
    window_attention,
)
from dcp_compile.ops.merge import lse_merge
from dcp_compile.ops.paged import gather_pages, paged_latent_prefix_attention, paged_prefix_attention
from dcp_compile.ops.triton_flash import prefix_flash_triton, window_flash_triton
from dcp_compile.ops.triton_latent import latent_prefix_attention_triton, latent_window_attention_triton
from dcp_compile.ops.triton_paged import paged_latent_prefix_attention_triton, paged_prefix_attention_triton
from dcp_compile.ops.triton_prefix import prefix_attention_any_width, prefix_attention_triton

__all__ = [
    "attention_with_lse", "blocked_attention", "latent_prefix_attention", "latent_prefix_attention_triton",
    "gather_pages", "latent_window_attention", "latent_window_attention_triton", "lse_merge",
    "paged_latent_prefix_attention", "paged_latent_prefix_attention_triton", "paged_prefix_attention",
    "paged_prefix_attention_triton",
    "prefix_attention", "prefix_attention_any_width", "prefix_attention_triton",
    "prefix_flash_triton", "window_attention", "window_flash_triton",
]
