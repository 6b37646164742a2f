"""find: locate the KV caches, their writes, and the attention calls that read them.

Precondition: ``gm`` is a Dynamo FX graph (torch-level ops) whose placeholders carry
``example_value`` fake tensors and whose nodes carry ``stack_trace``.

Result: a ``Plan``: the typed facts every later pass consumes, so nothing re-discovers
what this pass found.
- A *KV cache* is a graph input written in place along a sequence axis by
  ``index_copy_``, ``index_put_`` or ``__setitem__`` with a tensor of positions.
- An *attention site* is an ``F.scaled_dot_product_attention`` call, or attention
  written by hand (``softmax(q @ k.transpose(-2, -1) * scale + mask) @ v``), whose keys
  and values are caches, read directly or through a GQA replication (``enable_gqa``,
  ``repeat_interleave`` or ``expand`` + ``reshape``) and layout-only views, or computed
  from caches by a slot-wise map (``slotwise``: transformers' latent attention expands
  its cached latent per head with ``kv_b_proj``; ``AttentionSite.expanded``).

Each site also carries a ``MaskProof`` (``causal_mask``): whether its mask is the
position-causal one that the cascade computes.  An unproven mask is not an error here
(draft graphs and a group of one are never rewritten); ``shard_attention`` and
``dcp.prepare`` refuse it for sharded targets.

Invariant: every read of a cache is part of an attention site or a write.  Any other
read (a matmul over the cache, a view this pass does not understand, flex_attention)
raises ``GraphPatternError`` naming the node and the user's source line: a target
attention is never silently left unsharded.  Attention over tensors that do not come
from a cache is not a site and is left alone.

This pass never modifies the graph.
"""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from dcp_compile.passes.causal_mask import MaskProof, prove_causal
from dcp_compile.passes.fx_utils import (
    INDEX_VIEWS,
    LAYOUT_ONLY,
    GraphPatternError,
    arange_bounds,
    expand_ellipsis,
    arg,
    fake_value,
    is_flex_attention,
    is_sdpa,
    op_name,
    placeholder_name,
    shape_of,
    where,
)
from dcp_compile.passes.kv_index import WRITE_KINDS, WriteIndex, analyse_write, positions_node
from dcp_compile.passes.slotwise import Axes, SlotwiseMap, analyse as analyse_slotwise, reads_cache


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


def _placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _strip_views(node):
    """``node`` with the index views on top of it taken off."""
    while isinstance(node, Node) and op_name(node) in INDEX_VIEWS and node.args:
        node = node.args[0]
    return node


def _root_input(node) -> Node | None:
    """The placeholder ``node`` is a view of, following only single-input index views."""
    node = _strip_views(node)
    return node if isinstance(node, Node) and node.op == "placeholder" else None


def _arange_reach(node) -> int | None:
    """``T - 1`` for ``arange(T)`` or ``arange(0, T)`` with constant ``T`` (through views)."""
    bounds = arange_bounds(_strip_views(node))
    if bounds is None:
        return None
    start, end, step = bounds
    if start != 0 or step != 1 or not isinstance(end, int) or end < 1:
        return None
    return end - 1


def _position_source(node) -> tuple[Node, int] | None:
    """The placeholder that written positions come from, and their reach past its values."""
    root = _root_input(node)
    if root is not None:
        return root, 0
    node = _strip_views(node)
    if isinstance(node, Node) and op_name(node) == "add" and len(node.args) == 2:
        for base, offset in (node.args, node.args[::-1]):
            root, reach = _root_input(base), _arange_reach(offset)
            if root is not None and reach is not None:
                return root, reach
    return None


def _dim(d: int, ndim: int) -> int:
    return d % ndim


def _replay_read(chain: list[Node], cache: KVCache, expected: tuple[str, ...] = ("B", "H", "S", "D")) -> int:
    """Follow the ops from the cache to an attention argument, tracking what each axis
    holds; return the head replication factor.  Raises if the result is not a
    ``[B, H*r, S, D]`` read (``expected``: ``[B, H*r, D, S]`` for the keys of a
    hand-written ``q @ k.transpose(-2, -1)``) where query head ``h`` sees cache head
    ``h // r``."""
    tags = ["B", "H", "H", "D"]
    tags[cache.seq_dim] = "S"
    repeat = 1
    for node in chain:
        fail = GraphPatternError(
            f"target attention reads KV cache {cache.name} through {op_name(node)!r} at {where(node)}, a view the "
            f"passes do not understand (expected layout-only views and a GQA head replication)"
        )
        tags, factor = _read_step(node, tags, fail)
        repeat *= factor
        if len(tags) != len(shape_of(node)):
            raise fail
    if tags != list(expected):
        axes = {"S": "seq", "D": "head_dim", "B": "batch", "H": "heads"}
        raise GraphPatternError(
            f"target attention reads KV cache {cache.name} as axes {tags} (ending at {where(chain[-1]) if chain else cache.name}); "
            f"expected [{', '.join(axes[t] for t in expected)}] with heads replicated by repeat_interleave or expand"
        )
    return repeat


def _read_step(node: Node, tags: list[str], fail: GraphPatternError) -> tuple[list[str], int]:
    """What one op of a read chain does to the axes' tags (``B``, ``H``, ``S``, ``D``, a
    unit axis ``1``, a GQA group ``G``), and by how much it replicates the heads."""
    name = op_name(node)
    shape_in, shape_out = shape_of(node.args[0]), shape_of(node)
    tags = list(tags)
    if name in LAYOUT_ONLY:
        if shape_in != shape_out:
            raise fail
        return tags, 1
    if name in ("transpose", "swapaxes"):
        a, b = (_dim(int(d), len(tags)) for d in node.args[1:3])
        tags[a], tags[b] = tags[b], tags[a]
        return tags, 1
    if name == "permute":
        dims = node.args[1] if isinstance(node.args[1], (tuple, list)) else node.args[1:]
        return [tags[_dim(int(d), len(tags))] for d in dims], 1
    if name == "repeat_interleave":
        repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        if not isinstance(repeats, int) or dim is None or tags[_dim(int(dim), len(tags))] != "H":
            raise fail
        return tags, repeats
    if name == "unsqueeze":
        tags.insert(_dim(int(node.args[1]), len(tags) + 1), "1")
        return tags, 1
    if name == "getitem":
        index = expand_ellipsis(node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],), len(tags))
        new_tags, src = [], iter(tags)
        for entry in index:
            if entry is None:
                new_tags.append("1")
            elif entry == slice(None):
                new_tags.append(next(src))
            else:
                raise fail
        return new_tags + list(src), 1
    if name == "expand":
        for d, (old, new) in enumerate(zip(shape_in, shape_out)):
            if old != new:
                if tags[d] != "1":
                    raise fail
                tags[d] = "G"
        return tags, 1
    if name in ("reshape", "view", "flatten"):
        if shape_out == shape_in:
            return tags, 1
        # Folding a GQA group into the heads: [.., H, G, ..] -> [.., H*G, ..].
        merged = next((i for i in range(len(tags) - 1) if tags[i] == "H" and tags[i + 1] == "G"), None)
        if merged is not None and shape_out == (
            shape_in[:merged] + (shape_in[merged] * shape_in[merged + 1],) + shape_in[merged + 2 :]
        ):
            tags[merged : merged + 2] = ["H"]
            return tags, shape_in[merged + 1]
    raise fail


def _read_chain(node: Node, caches: dict[Node, KVCache]) -> tuple[KVCache, list[Node]] | None:
    """The single-input op chain from a cache to ``node``; None if it is not one."""
    chain = []
    while node not in caches:
        if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], Node):
            return None
        if len(node.all_input_nodes) != 1:
            return None
        chain.append(node)
        node = node.args[0]
    return caches[node], chain[::-1]


def _collect_writes(gm: GraphModule, input_index: dict[Node, int]) -> dict[Node, KVWrite]:
    """Every KV write, by the cache it writes: one write per cache, into the cache itself."""
    writes_by_cache: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if op_name(node) not in WRITE_KINDS or not node.args or not isinstance(node.args[0], Node):
            continue
        target = node.args[0]
        if target.op == "placeholder":
            writes_by_cache.setdefault(target, []).append(node)
        elif _root_input(target) is not None and isinstance(fake_value(node.args[0]), torch.Tensor):
            raise GraphPatternError(
                f"{op_name(node)} at {where(node)} writes into a view of graph input "
                f"{placeholder_name(_root_input(target))}; expected KV writes into the cache buffer itself"
            )
    writes: dict[Node, KVWrite] = {}
    for cache_node, write_nodes in writes_by_cache.items():
        if len(write_nodes) != 1:
            lines = "; ".join(where(w) for w in write_nodes)
            raise GraphPatternError(
                f"KV cache {placeholder_name(cache_node)} is written {len(write_nodes)} times in one graph ({lines}); "
                f"expected one write per cache per forward"
            )
        write_node = write_nodes[0]
        index = analyse_write(write_node, cache_node)
        cache = KVCache(cache_node, input_index[cache_node], placeholder_name(cache_node), index.seq_dim)
        value = arg(write_node, 3, "source") if index.kind == "index_copy_" else write_node.args[2]
        writes[cache_node] = KVWrite(write_node, cache, index, positions_node(write_node, index), value)
    return writes


def _make_site(node: Node, query: Node, k_read, v_read, writes: dict[Node, KVWrite], scale: float, mask,
               is_causal: bool, k_expected=("B", "H", "S", "D")) -> AttentionSite:
    """The site at ``node`` (the attention's output) once both reads are checked."""
    (k_cache, k_chain), (v_cache, v_chain) = k_read, v_read
    _replay_read(k_chain, k_cache, k_expected)
    _replay_read(v_chain, v_cache)
    if k_cache.node is v_cache.node:
        raise GraphPatternError(f"attention at {where(node)} reads one cache ({k_cache.name}) as both keys and values")
    k_write, v_write = writes[k_cache.node], writes[v_cache.node]
    if k_write.positions is not v_write.positions:
        raise GraphPatternError(
            f"attention at {where(node)} reads caches written at different position tensors "
            f"({where(k_write.node)} and {where(v_write.node)}); expected one positions tensor per layer"
        )
    proof = prove_causal(node, mask, is_causal, k_write.positions, k_write.index.position_tags)
    return AttentionSite(node, query, k_write, v_write, scale, proof)


def _sdpa_scale(node: Node) -> float:
    """An SDPA call's softmax scale: its ``scale``, else ``1 / sqrt(query width)``."""
    scale = arg(node, 6, "scale", None)
    return float(scale) if scale is not None else 1.0 / math.sqrt(shape_of(node.args[0])[-1])


def _refuse_sdpa_dropout(node: Node) -> None:
    if arg(node, 4, "dropout_p", 0.0):
        raise GraphPatternError(f"attention at {where(node)} uses dropout; dcp-compile compiles inference graphs")


def _sdpa_site(node: Node, caches: dict[Node, KVCache], writes: dict[Node, KVWrite], earlier: AbstractSet[Node]):
    """An ``F.scaled_dot_product_attention`` over two caches, or None if it reads none."""
    q, k, v = node.args[:3]
    reads = [_read_chain(operand, caches) for operand in (k, v)]
    if reads[0] is None and reads[1] is not None:
        latent = _latent_sdpa_site(node, caches, writes, reads[1])
        if latent is not None:
            return latent
    scale = _sdpa_scale(node)
    if any(r is None for r in reads):
        # Not two cache reads: keys and values computed from caches, or no cache at all.
        found = _expanded_site(node, q, k, v, caches, writes, scale, arg(node, 3, "attn_mask"),
                               arg(node, 5, "is_causal", False), earlier, keys_transposed=False)
        if found is not None:
            _refuse_sdpa_dropout(node)
        return found
    _refuse_sdpa_dropout(node)
    site = _make_site(node, q, *reads, writes, scale, arg(node, 3, "attn_mask"), arg(node, 5, "is_causal", False))
    return site, [*reads[0][1], *reads[1][1], node]


def _one_head(node, chain: list[Node]) -> bool:
    """Whether ``chain`` takes a ``[B, S, W]`` tensor to ``[B, 1, S, W]`` (``[:, None]``,
    ``unsqueeze(1)``) through layout-only ops."""
    if len(shape_of(node)) != 4 or shape_of(node)[1] != 1:
        return False
    for step in chain:
        name = op_name(step)
        if name == "unsqueeze" and int(step.args[1]) % 4 == 1:
            continue
        if name == "getitem":
            index = step.args[1] if isinstance(step.args[1], tuple) else (step.args[1],)
            if list(index) in ([slice(None), None], [slice(None), None, Ellipsis], [slice(None), None, slice(None), slice(None)]):
                continue
        if name in LAYOUT_ONLY and shape_of(step) == shape_of(step.args[0]):
            continue
        return False
    return True


def _latent_sdpa_site(node: Node, caches: dict[Node, KVCache], writes: dict[Node, KVWrite], v_read):
    """MLA written with SDPA: ``scaled_dot_product_attention(cat([q_abs, q_pe], -1),
    cat([kv_cache, pe_cache], -1)[:, None], kv_cache[:, None], enable_gqa=True)`` (keys
    576 wide, values 512 in DeepSeek's shapes); None if the keys are not that."""
    value_cache, v_chain = v_read
    if value_cache.seq_dim != 1 or len(shape_of(value_cache.node)) != 3 or not _one_head(node.args[2], v_chain):
        return None
    k_chain, keys = [], node.args[1]
    while isinstance(keys, Node) and op_name(keys) != "cat" and len(keys.all_input_nodes) == 1:
        k_chain.append(keys)
        keys = keys.args[0]
    if not isinstance(keys, Node) or op_name(keys) != "cat" or not _one_head(node.args[1], k_chain[::-1]):
        return None
    parts, dim = keys.args[0], arg(keys, 1, "dim", 0)
    if len(parts) != 2 or int(dim) % 3 != 2 or not all(isinstance(p, Node) and p in caches for p in parts):
        return None
    if parts[0] is not value_cache.node:
        raise GraphPatternError(
            f"the latent attention at {where(node)} concatenates its keys as [{caches[parts[0]].name}, "
            f"{caches[parts[1]].name}] but reads {value_cache.name} as values; expected the latent cache first"
        )
    latent_write, rope_write = writes[parts[0]], writes[parts[1]]
    if rope_write.positions is not latent_write.positions:
        raise GraphPatternError(
            f"the latent and rope-key caches read at {where(node)} are written at different position tensors "
            f"({where(latent_write.node)} and {where(rope_write.node)}); expected one positions tensor per layer"
        )
    _refuse_sdpa_dropout(node)
    q, scale = node.args[0], _sdpa_scale(node)
    proof = prove_causal(node, arg(node, 3, "attn_mask"), arg(node, 5, "is_causal", False), latent_write.positions,
                         latent_write.index.position_tags)
    identity = (0, 1, 2, 3)
    site = AttentionSite(node, q, latent_write, latent_write, scale, proof, LatentParts(None, rope_write, identity, identity))
    return site, [*v_chain, *k_chain, keys, node]


def _expanded_site(node: Node, query: Node, keys: Node, values: Node, caches: dict[Node, KVCache],
                   writes: dict[Node, KVWrite], scale: float, mask, is_causal: bool, earlier: AbstractSet[Node], *,
                   keys_transposed: bool, scores: Node | None = None):
    """Attention whose keys and values a slot-wise map computes from caches, or None if
    they read no cache.  ``earlier``: the sites found before it; ``scores``: the product
    of a hand-written attention that takes the keys."""
    smap = analyse_slotwise(node, [keys, values], caches, (scores,) if scores is not None else (), earlier)
    if smap is None:
        return None
    expected = {keys: Axes(0, 3 if keys_transposed else 2), values: Axes(0, 2)}
    for operand, axes in expected.items():
        found = smap.axes.get(operand)
        if found != axes or len(shape_of(operand)) != 4:
            held = ("are not computed from a KV cache" if found is None
                    else f"hold the batch and cache slots on axes {(found.batch, found.slot)}")
            raise GraphPatternError(
                f"attention at {where(node)} reads {'keys' if operand is keys else 'values'} {operand.name} that "
                f"{held}; expected [batch, heads, slots, width] computed from the caches"
            )
    site_writes = tuple(writes[c] for c in smap.caches)
    first = site_writes[0]
    if any(w.positions is not first.positions for w in site_writes):
        raise GraphPatternError(
            f"attention at {where(node)} reads caches written at different position tensors "
            f"({', '.join(where(w.node) for w in site_writes)}); expected one positions tensor per layer"
        )
    proof = prove_causal(node, mask, is_causal, first.positions, first.index.position_tags)
    expanded = ExpandedKV(smap, keys, values, site_writes)
    return AttentionSite(node, query, first, first, scale, proof, expanded=expanded), [*smap.nodes, node]


_MATMULS = frozenset({"matmul", "bmm", "__matmul__"})
_PROB_CASTS = frozenset({"to", "type_as", "float", "half", "bfloat16", "type", "contiguous"})


def _fill_is_minus_infinity(value) -> bool:
    # As the mask prover reads where(allowed, 0, other): any fill whose exp underflows to 0.
    return isinstance(value, (int, float)) and value <= -1e4


def _peel_probs(node: Node):
    """From a value product's weights back to the softmax: ``(softmax, steps)``, or None."""
    steps, probs = [], node
    while isinstance(probs, Node) and (op_name(probs) in _PROB_CASTS or op_name(probs) == "dropout"):
        if op_name(probs) == "dropout" and arg(probs, 1, "p", 0.5) and arg(probs, 2, "training", True):
            raise GraphPatternError(f"attention at {where(probs)} uses dropout; dcp-compile compiles inference graphs")
        steps.append(probs)
        probs = probs.args[0]
    if not isinstance(probs, Node) or op_name(probs) != "softmax":
        return None
    dim = arg(probs, 1, "dim")
    ndim = len(shape_of(probs))
    if dim is None or int(dim) % ndim != ndim - 1:
        raise GraphPatternError(f"the softmax at {where(probs)} runs over axis {dim}, not over the keys (the last axis)")
    return probs, steps + [probs]


def _peel_scores(probs: Node, caches: dict[Node, KVCache]):
    """From the softmax to the raw scores: ``(scores, scale, mask, steps)``, taking off
    casts, a constant scale or divisor, and one mask (added, or a masked_fill of an
    inverted keep-mask with -inf).  Stops at a sum of two cache-reading terms."""
    steps, scores, scale, mask = [], probs.args[0], 1.0, None
    while True:
        name = op_name(scores) if isinstance(scores, Node) else None
        if name in _PROB_CASTS:
            steps.append(scores)
            scores = scores.args[0]
        elif name in ("mul", "truediv", "div") and isinstance(scores.args[1], (int, float)):
            steps.append(scores)
            scale = scale * scores.args[1] if name == "mul" else scale / scores.args[1]
            scores = scores.args[0]
        elif name == "mul" and isinstance(scores.args[0], (int, float)):
            steps.append(scores)
            scale, scores = scale * scores.args[0], scores.args[1]
        elif name == "add" and mask is None:
            reading = [a for a in scores.args[:2] if isinstance(a, Node) and reads_cache(a, caches, frozenset())]
            if len(reading) != 1:
                break  # both terms read caches: MLA's latent + rope scores
            steps.append(scores)
            mask = next(a for a in scores.args[:2] if a is not reading[0])
            scores = reading[0]
        elif name == "masked_fill" and mask is None:
            condition, fill = scores.args[1], arg(scores, 2, "value")
            inverted = isinstance(condition, Node) and op_name(condition) in ("invert", "logical_not",
                                                                               "bitwise_not", "__invert__")
            if not inverted or not _fill_is_minus_infinity(fill):
                raise GraphPatternError(
                    f"the attention scores at {where(scores)} are masked by masked_fill({condition}, {fill!r}); "
                    f"the passes read a fill as masked_fill(~allowed, -inf): write the mask that way, or add "
                    f"torch.where(allowed, 0, -inf)"
                )
            steps.append(scores)
            scores, mask = scores.args[0], condition.args[0]
        else:
            return scores, scale, mask, steps


def _matmul_site(node: Node, caches: dict[Node, KVCache], writes: dict[Node, KVWrite], earlier: AbstractSet[Node]):
    """Attention written by hand over two caches: ``softmax(q @ k.transpose(-2, -1) *
    scale + mask) @ v`` (nanoGPT, Hugging Face eager, reference code), with the scale a
    constant factor or divisor anywhere on the scores, the mask added (``where(allowed,
    0, -inf)``) or filled (``masked_fill(~allowed, -inf)``), and casts (and an inactive
    dropout) around the softmax.  ``node`` is the product with the values; None if it is
    not one over a cache."""
    if op_name(node) not in _MATMULS or len(node.args) != 2:
        return None
    v_read = _read_chain(node.args[1], caches)
    if v_read is None and not reads_cache(node.args[1], caches, earlier):
        return None  # a product of tensors that hold no cache's slots
    peeled = _peel_probs(node.args[0])
    if peeled is None:
        return None  # not attention's value product; a cache read left unexplained is refused later
    probs, prob_steps = peeled
    scores, scale, mask, score_steps = _peel_scores(probs, caches)
    if v_read is None:
        # Values computed from caches (or none read): keys and values slot by slot.
        if op_name(scores) not in _MATMULS or len(scores.args) != 2:
            return None
        found = _expanded_site(node, scores.args[0], scores.args[1], node.args[1], caches, writes, scale, mask,
                               False, earlier, keys_transposed=True, scores=scores)
        return None if found is None else (found[0], [*found[1], *prob_steps, *score_steps, scores])
    if op_name(scores) not in _MATMULS or len(scores.args) != 2:
        raise GraphPatternError(
            f"the softmax at {where(probs)} over values of KV cache {v_read[0].name} is taken of "
            f"{op_name(scores) if isinstance(scores, Node) else scores!r} at {where(scores) if isinstance(scores, Node) else '?'}, "
            f"not of q @ k.transpose(-2, -1) (times a constant, plus a mask)"
        )
    k_read = _read_chain(scores.args[1], caches)
    if k_read is None:
        raise GraphPatternError(
            f"the scores at {where(scores)} are not taken against a KV cache's keys, but the softmax over them "
            f"weighs the values of KV cache {v_read[0].name}"
        )
    site = _make_site(node, scores.args[0], k_read, v_read, writes, scale, mask, False, ("B", "H", "D", "S"))
    return site, [*k_read[1], *v_read[1], node, *prob_steps, *score_steps, scores]


def _einsum_parts(node: Node) -> tuple[list[str], str] | None:
    """``(operand subscripts, output subscripts)`` of a two-operand explicit einsum."""
    if op_name(node) != "einsum" or not isinstance(node.args[0], str):
        return None
    operands = node.args[1:] if len(node.args) > 2 else tuple(node.args[1]) if isinstance(node.args[1], (list, tuple)) else ()
    equation = node.args[0].replace(" ", "")
    if "->" not in equation or "." in equation or len(operands) != 2:
        return None
    inputs, output = equation.split("->")
    return inputs.split(","), output


def _einsum_operands(node: Node) -> tuple:
    return tuple(node.args[1:]) if len(node.args) > 2 else tuple(node.args[1])


def _latent_term(term: Node, caches: dict[Node, KVCache]):
    """One score term ``einsum("<q>,bsc-><q without c>s", q, cache)`` over a ``[B, S, C]``
    cache: ``(cache, query, query subscripts, output subscripts)``, or None."""
    parts = _einsum_parts(term) if isinstance(term, Node) else None
    if parts is None:
        return None
    (q_sub, c_sub), out_sub = parts
    q, cache = _einsum_operands(term)
    if not isinstance(cache, Node) or cache not in caches or len(c_sub) != 3 or caches[cache].seq_dim != 1:
        return None
    b, s_letter, c = c_sub
    if len(q_sub) != 4 or q_sub[0] != b or c not in q_sub or q_sub[-1] != c:
        return None
    if out_sub != q_sub[:-1] + s_letter:
        return None
    return caches[cache], q, q_sub, out_sub


def _einsum_site(node: Node, caches: dict[Node, KVCache], writes: dict[Node, KVWrite]):
    """MLA's absorbed attention (DeepSeek's ``attn_impl == "absorb"`` decode)::

        scores = (einsum("bthc,bsc->bths", q_lat, kv_cache)
                  + einsum("bthr,bsr->bths", q_pe, pe_cache)) * scale
        probs  = softmax(scores masked, dim=-1)
        o_lat  = einsum("bths,bsc->bthc", probs, kv_cache)      # ``node``

    with the caches ``[B, S, C]`` and ``[B, S, R]`` written at one position tensor.
    Any letters and any order of the token and head axes; None if ``node`` is not the
    value product of such an attention."""
    parts = _einsum_parts(node)
    if parts is None:
        return None
    (p_sub, c_sub), out_sub = parts
    probs_node, value = _einsum_operands(node)
    if not isinstance(value, Node) or value not in caches or len(c_sub) != 3 or len(p_sub) != 4:
        return None
    peeled = _peel_probs(probs_node)
    if peeled is None:
        return None
    value_cache = caches[value]
    probs, prob_steps = peeled
    b, s_letter, c = c_sub
    if value_cache.seq_dim != 1 or p_sub[0] != b or p_sub[-1] != s_letter or out_sub != p_sub[:-1] + c:
        raise GraphPatternError(
            f"the value product at {where(node)} ({node.args[0]!r}) is not probs[b, ., ., s] x cache[b, s, c] summed "
            f"over s; the passes shard MLA's absorbed attention written that way"
        )
    scores, scale, mask, score_steps = _peel_scores(probs, caches)
    terms = list(scores.args[:2]) if op_name(scores) == "add" else [scores]
    found = [_latent_term(t, caches) for t in terms]
    if any(f is None for f in found):
        raise GraphPatternError(
            f"the softmax at {where(probs)} over values of KV cache {value_cache.name} is taken of scores at "
            f"{where(scores)} that are not a sum of einsum(\"bthc,bsc->bths\", query, cache) terms over [B, S, C] caches"
        )
    latent = [f for f in found if f[0].node is value]
    rope = [f for f in found if f[0].node is not value]
    if len(latent) != 1 or len(rope) > 1:
        raise GraphPatternError(
            f"the scores at {where(scores)} must hold one term over the value cache {value_cache.name} (the latent) "
            f"and at most one over another cache (the rope key)"
        )
    (_, q_latent, q_sub, score_sub) = latent[0]
    letters = score_sub[1:3]
    if score_sub[:3] != p_sub[:3] or any(f[3][:3] != score_sub[:3] for f in found):
        raise GraphPatternError(f"the score terms at {where(scores)} and the value product at {where(node)} lay out their axes differently")
    latent_write = writes[value]
    positions = latent_write.positions
    tokens = latent_write.index.tokens
    sizes = dict(zip(q_sub, shape_of(q_latent)))
    # Which of the two middle axes holds the new tokens: the one as long as the write's
    # tokens; where both are, the mask proof decides.
    candidates = [i for i, letter in enumerate(letters) if sizes[letter] == tokens] or [0, 1]
    proofs = []
    for t_axis in candidates:
        axes = "b" + ("th" if t_axis == 0 else "ht") + "s"
        proofs.append((t_axis, prove_causal(node, mask, False, positions, latent_write.index.position_tags, axes)))
    t_axis, proof = next(((t, p) for t, p in proofs if p.proven), proofs[0])
    h_axis = 1 - t_axis
    query_perm = (0, 1 + h_axis, 1 + t_axis, 3)
    out_perm = tuple(query_perm.index(i) for i in range(4))
    rope_write, rope_query = (writes[rope[0][0].node], rope[0][1]) if rope else (None, None)
    if rope_write is not None and rope_write.positions is not positions:
        raise GraphPatternError(
            f"the latent and rope-key caches read at {where(scores)} are written at different position tensors "
            f"({where(latent_write.node)} and {where(rope_write.node)}); expected one positions tensor per layer"
        )
    if rope_write is None:
        raise GraphPatternError(f"the latent attention at {where(node)} has no rope-key term; the passes shard MLA's latent + rope form")
    parts_ = LatentParts(rope_query, rope_write, query_perm, out_perm)
    site = AttentionSite(node, q_latent, latent_write, latent_write, scale, proof, parts_)
    term_nodes = terms + ([scores] if len(terms) == 2 else [])
    return site, [node, *prob_steps, *score_steps, *term_nodes]


def _collect_sites(gm: GraphModule, writes: dict[Node, KVWrite]) -> tuple[list[AttentionSite], set[Node]]:
    """Every attention over two caches (SDPA, or written by hand), with its mask proof;
    and the nodes those reads explain."""
    caches = {node: w.cache for node, w in writes.items()}
    sites: list[AttentionSite] = []
    explained: set[Node] = {w.node for w in writes.values()}
    earlier: set[Node] = set()  # the sites found so far: a later site's search for its caches stops there
    for node in gm.graph.nodes:
        if is_sdpa(node):
            found = _sdpa_site(node, caches, writes, earlier)
        elif op_name(node) == "einsum":
            found = _einsum_site(node, caches, writes)
        else:
            found = _matmul_site(node, caches, writes, earlier)
        if found is not None:
            site, nodes = found
            sites.append(site)
            earlier.add(site.node)
            explained.update(nodes)
    return sites, explained


def _check_reads(gm: GraphModule, caches, explained: set[Node], site_nodes: set[Node]) -> None:
    """Everything that consumes cache data must be a write, a recognised view chain, or
    a site (whose output is attention, no longer cache data)."""
    frontier, seen, unexplained = list(caches), set(caches), []
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user not in explained:
                unexplained.append(user)
            elif user not in site_nodes and op_name(user) not in WRITE_KINDS:
                frontier.append(user)
    if not unexplained:
        return
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    first = min(unexplained, key=order.__getitem__)
    if is_flex_attention(first):
        raise GraphPatternError(
            f"flex_attention over a KV cache at {where(first)} is not supported yet; "
            f"use F.scaled_dot_product_attention for attention over the cache"
        )
    raise GraphPatternError(
        f"a KV cache is read by {op_name(first) or first.op!r} at {where(first)}, which the passes cannot "
        f"shard; read caches only through F.scaled_dot_product_attention, softmax(q @ k.transpose(-2, -1) * "
        f"scale + mask) @ v, or MLA's absorbed einsum form, directly or through layout views and a GQA head "
        f"replication"
    )


def find(gm: GraphModule) -> Plan:
    """Analyse ``gm``; see the module docstring for what is found and what raises."""
    input_index = {node: i for i, node in enumerate(_placeholders(gm))}
    writes = _collect_writes(gm, input_index)
    sites, explained = _collect_sites(gm, writes)
    _check_reads(gm, list(writes), explained, {site.node for site in sites})
    mask_inputs = {input_index[t] for site in sites if site.mask.proven for t in site.mask.tables}
    position_inputs = {
        (input_index[source[0]], source[1])
        for w in writes.values() if (source := _position_source(w.positions)) is not None
    }
    return Plan(
        caches=tuple(w.cache for w in writes.values()),
        writes=tuple(writes.values()),
        sites=tuple(sites),
        mask_inputs=tuple(sorted(mask_inputs)),
        position_inputs=tuple(sorted(position_inputs)),
    )
