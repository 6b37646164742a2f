"""The two RoPE layouts of a head's query/key rows, and the row permutations between them.

RoPE rotates pairs of a head's ``hd`` channels, pair ``i`` by angle ``position * theta^(-2i/hd)``.
Which channels form pair ``i`` is a convention of the checkpoint:

- **interleaved** (this package's ``apply_rope``, Meta's original Llama, gpt-fast): channels
  ``(2i, 2i + 1)``;
- **rotate-half** (Hugging Face ``transformers``, and so every published EAGLE draft, vLLM
  and SGLang with ``is_neox_style``): channels ``(i, i + hd/2)``, rotated as
  ``q * cos + rotate_half(q) * sin`` with ``cos``/``sin`` over ``cat(freqs, freqs)``.

A checkpoint moves between them by permuting the rows of ``q_proj``/``k_proj`` within each
head: interleaved row ``2i + c`` is rotate-half row ``c * hd/2 + i`` (``c`` in {0, 1}).
Queries and keys are permuted alike, so every attention score, and the model's output, is
unchanged; ``v_proj`` and ``o_proj`` are not rotated and keep their rows.
"""

from __future__ import annotations

import torch


def _heads(w: torch.Tensor, n_heads: int) -> tuple[int, tuple[int, ...]]:
    """Head width and the trailing shape of ``w [n_heads * hd, ...]`` (a weight, or a 1-D bias)."""
    rows = w.shape[0]
    if n_heads < 1 or rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(
            f"a q/k projection of {rows} rows cannot be split into {n_heads} heads of an even width (RoPE rotates "
            f"pairs); pass the number of heads the projection produces (query heads for q, KV heads for k)"
        )
    return rows // n_heads, tuple(w.shape[1:])


def interleaved_to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection ``[n_heads * hd, ...]`` from interleaved pairs to rotate-half
    (this package's weights -> Hugging Face's)."""
    hd, rest = _heads(w, n_heads)
    # [head, pair i, c] -> [head, c, pair i]
    return w.reshape(n_heads, hd // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def rotate_half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse: rows from rotate-half to interleaved pairs (Hugging Face's -> this
    package's); transformers' ``convert_llama_weights_to_hf`` ``permute`` undone."""
    hd, rest = _heads(w, n_heads)
    # [head, c, pair i] -> [head, pair i, c]
    return w.reshape(n_heads, 2, hd // 2, *rest).transpose(1, 2).reshape(w.shape)
