"""The typed facts ``find`` establishes about a graph, which every later pass consumes:
the KV caches, their writes, and the attention sites that read them (``Plan``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from dcp_compile.passes.causal_mask import MaskProof
from dcp_compile.passes.kv_index import WriteIndex
from dcp_compile.passes.slotwise import SlotwiseMap


@dataclass(frozen=True)
class KVCache:
    node: Node
    input_index: int
    """Position among the graph's placeholders (= index into the backend's example_inputs)."""
    name: str
    seq_dim: int


@dataclass(frozen=True)
class KVWrite:
    node: Node
    cache: KVCache
    index: WriteIndex
    positions: Node
    value: Node


@dataclass(frozen=True)
class LatentParts:
    """MLA's absorbed attention: the scores add ``query . latent`` and ``rope_query .
    rope_key`` over two caches written at one position tensor, and the values are the
    latent cache itself (``AttentionSite.k_write`` is ``v_write``, the latent's write)."""

    rope_query: Node | None
    """``None``: the site's query already holds ``[q_latent | q_rope]`` (the SDPA spelling)."""
    rope_write: KVWrite
    query_perm: tuple[int, ...]
    """Permutes the queries' axes (as the user's einsums hold them) to ``[B, H, T, .]``."""
    out_perm: tuple[int, ...]
    """Permutes ``[B, H, T, C]`` to the axis order of the site's output."""


@dataclass(frozen=True)
class ExpandedKV:
    """Keys and values the site computes from its caches slot by slot (transformers'
    multi-head latent attention expands a cached latent with ``kv_b_proj``); the prefix
    reads them as the map gives them over this rank's slots, the window replays the map on
    the new tokens (``slotwise``)."""

    map: SlotwiseMap
    keys: Node
    """The site's key operand: ``[B, H, S, D]`` (SDPA) or ``[B, H, D, S]`` (``q @ k^T``)."""
    values: Node
    """``[B, H, S, Dv]``."""
    writes: tuple[KVWrite, ...]
    """The write of each cache the map reads, in ``map.caches`` order."""


@dataclass(frozen=True)
class AttentionSite:
    node: Node
    query: Node
    k_write: KVWrite
    v_write: KVWrite
    scale: float
    mask: MaskProof
    """Whether the user's mask is the position-causal one the cascade computes."""
    latent: LatentParts | None = None
    expanded: ExpandedKV | None = None


@dataclass(frozen=True)
class Plan:
    caches: tuple[KVCache, ...]
    writes: tuple[KVWrite, ...]
    sites: tuple[AttentionSite, ...]
    mask_inputs: tuple[int, ...]
    """Placeholder indices of causal-mask tables (``[positions, slots]``, gpt-fast's
    ``causal_mask``) that proven masks index; their last axis runs along the cache's
    sequence axis, and the proofs assume them lower triangular."""
    position_inputs: tuple[tuple[int, int], ...]
    """``(placeholder index, reach)``: the positions written this step lie between that
    input's smallest value and its largest value plus ``reach`` (0 when the input holds
    the positions; ``T - 1`` for ``arange(T) + length``, Hugging Face's form)."""
