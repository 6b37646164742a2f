"""What the Triton attention kernels accept, checked before a launch: every refusal says
what was expected, what came and the fix."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_inputs(
    form: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: torch.Tensor, kernel: str = "flash-attention"
) -> None:
    """Refuse what a Triton attention kernel cannot run, saying what it expected, what it
    got and the fix; ``form`` is ``"prefix"`` (``extra`` = kv_len) or ``"window"``
    (``extra`` = positions); ``kernel`` names the kernel in the messages.  The kernels
    mask the head axis, so the values may be narrower or wider than the keys and neither
    width need be a power of two; each is at most 256."""
    kv = ("k_cache", "v_cache") if form == "prefix" else ("k_new", "v_new")
    keys = "S" if form == "prefix" else "T"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or v.shape[:-1] != k.shape[:-1]:
        raise ValueError(
            f"{form}_attention expects q [B,Hq,T,D], {kv[0]} [B,Hkv,{keys},D] and {kv[1]} [B,Hkv,{keys},Dv]; got q "
            f"{tuple(q.shape)}, {kv[0]} {tuple(k.shape)}, {kv[1]} {tuple(v.shape)}"
        )
    B, Hq, T, D = q.shape
    Bk, Hkv, Sk, Dk = k.shape
    if Bk != B or Dk != D or Hkv == 0 or Hq % Hkv or (form == "window" and Sk != T):
        same_t = " and the same T (one key per new token)" if form == "window" else ""
        raise ValueError(
            f"{form}_attention: q {tuple(q.shape)} does not match {kv[0]} {tuple(k.shape)}: need the same B and "
            f"D{same_t}, and Hq a multiple of Hkv; transpose to [B, heads, tokens, D] if the heads are not dim 1"
        )
    if kernel_width(D, v.shape[-1]) is None:
        raise ValueError(f"the Triton {kernel} kernel takes keys and values at most 256 wide, got {D} and "
                         f"{v.shape[-1]}: run the reference (dcp_compile.ops.prefix_attention and window_attention "
                         f"run it on CUDA for such widths)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"the Triton {kernel} kernel takes q, {kv[0]}, {kv[1]} of one dtype among {SUPPORTED_DTYPES}; "
            f"got {q.dtype}, {k.dtype}, {v.dtype}: cast them to one of those"
        )
    window = form == "window"
    check_index(f"{form}_attention", "positions" if window else "kv_len", extra, B, T if window else None,
                {"q": q, kv[0]: k, kv[1]: v})


def check_index(op: str, name: str, index: torch.Tensor, B: int, T: int | None, operands: dict) -> None:
    """``index`` (``kv_len [B]``, or ``positions [B, T]`` where ``T`` is given) must be an
    integer tensor of that shape on the one device of ``operands`` (name -> tensor): the
    kernels index memory with it.  ``op`` names the caller in the messages."""
    shape = (B,) if T is None else (B, T)
    if tuple(index.shape) != shape or index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise ValueError(
            f"{name} must be an integer tensor {list(shape)} (B={B}" + (f", T={T}" if T is not None else "")
            + f"), got {index.dtype} {tuple(index.shape)}"
        )
    devices = {t.device for t in (*operands.values(), index)}
    if len(devices) > 1:
        raise ValueError(
            f"{op}: {', '.join(operands)} and {name} must be on one device, got "
            f"{', '.join(str(t.device) for t in operands.values())}, {index.device}; move {name} with .to(q.device)"
        )


def check_lower(op: str, name: str, lower: torch.Tensor | None, q: torch.Tensor) -> None:
    """A left-padding bound, where given, is an integer tensor ``[B]`` on ``q``'s device."""
    if lower is not None:
        check_index(op, name, lower, int(q.shape[0]), None, {"q": q})


def kernel_width(k_width: int, v_width: int) -> int | None:
    """The head width the Triton kernels run keys ``k_width`` and values ``v_width``
    wide at: the power of two in ``[16, 256]`` at or above both; None past 256."""
    width = max(16, 1 << (max(k_width, v_width) - 1).bit_length())
    return width if width <= 256 else None
