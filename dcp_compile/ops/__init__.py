"""Ops the passes insert: reference implementations first (plain torch, fp32 math)."""

from dcp_compile.ops.attention import attention_with_lse, prefix_attention, window_attention
from dcp_compile.ops.merge import lse_merge

__all__ = ["attention_with_lse", "lse_merge", "prefix_attention", "window_attention"]
