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
  ``repeat_interleave`` or ``expand`` + ``reshape``) and layout-only views.

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
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from dcp_compile.passes.causal_mask import MaskProof, prove_causal
from dcp_compile.passes.fx_utils import (
    INDEX_VIEWS,
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
class AttentionSite:
    node: Node
    query: Node
    k_write: KVWrite
    v_write: KVWrite
    scale: float
    mask: MaskProof
    """Whether the user's mask is the position-causal one the cascade computes."""


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


_LAYOUT_ONLY = frozenset(
    {"contiguous", "to", "float", "half", "bfloat16", "type_as", "clone", "detach", "type"}
)


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
    if name in _LAYOUT_ONLY:
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


def _sdpa_site(node: Node, caches: dict[Node, KVCache], writes: dict[Node, KVWrite]):
    """An ``F.scaled_dot_product_attention`` over two caches, or None if it reads none."""
    q, k, v = node.args[:3]
    reads = [_read_chain(operand, caches) for operand in (k, v)]
    if any(r is None for r in reads):
        return None  # not over two caches: either no cache at all, or caught as an unexplained read
    if arg(node, 4, "dropout_p", 0.0):
        raise GraphPatternError(f"attention at {where(node)} uses dropout; dcp-compile compiles inference graphs")
    scale = arg(node, 6, "scale", None)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(shape_of(q)[-1])
    site = _make_site(node, q, *reads, writes, scale, arg(node, 3, "attn_mask"), arg(node, 5, "is_causal", False))
    return site, [*reads[0][1], *reads[1][1], node]


_MATMULS = frozenset({"matmul", "bmm", "__matmul__"})
_PROB_CASTS = frozenset({"to", "type_as", "float", "half", "bfloat16", "type", "contiguous"})


def _fill_is_minus_infinity(value) -> bool:
    # As the mask prover reads where(allowed, 0, other): any fill whose exp underflows to 0.
    return isinstance(value, (int, float)) and value <= -1e4


def _matmul_site(node: Node, caches: dict[Node, KVCache], writes: dict[Node, KVWrite]):
    """Attention written by hand over two caches: ``softmax(q @ k.transpose(-2, -1) *
    scale + mask) @ v`` (nanoGPT, Hugging Face eager, reference code), with the scale a
    constant factor or divisor anywhere on the scores, the mask added (``where(allowed,
    0, -inf)``) or filled (``masked_fill(~allowed, -inf)``), and casts (and an inactive
    dropout) around the softmax.  ``node`` is the product with the values; None if it is not one over a cache."""
    if op_name(node) not in _MATMULS or len(node.args) != 2:
        return None
    v_read = _read_chain(node.args[1], caches)
    if v_read is None:
        return None
    steps = [node]
    probs = node.args[0]
    while isinstance(probs, Node) and (op_name(probs) in _PROB_CASTS or op_name(probs) == "dropout"):
        if op_name(probs) == "dropout" and arg(probs, 1, "p", 0.5) and arg(probs, 2, "training", True):
            raise GraphPatternError(f"attention at {where(probs)} uses dropout; dcp-compile compiles inference graphs")
        steps.append(probs)
        probs = probs.args[0]
    if not isinstance(probs, Node) or op_name(probs) != "softmax":
        return None  # not attention's value product; a cache read left unexplained is refused later
    dim = arg(probs, 1, "dim")
    ndim = len(shape_of(probs))
    if dim is None or int(dim) % ndim != ndim - 1:
        raise GraphPatternError(f"the softmax at {where(probs)} runs over axis {dim}, not over the keys (the last axis)")
    steps.append(probs)
    scores, scale, mask = probs.args[0], 1.0, None
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
        elif name in ("add", "masked_fill") and mask is None:
            if name == "add":
                score_side = next((a for a in scores.args[:2] if isinstance(a, Node) and _reaches_cache(a, caches)), None)
                mask = next((a for a in scores.args[:2] if a is not score_side), None)
            else:
                condition, fill = scores.args[1], arg(scores, 2, "value")
                inverted = isinstance(condition, Node) and op_name(condition) in ("invert", "logical_not",
                                                                                   "bitwise_not", "__invert__")
                if not inverted or not _fill_is_minus_infinity(fill):
                    raise GraphPatternError(
                        f"the attention scores at {where(scores)} are masked by masked_fill({condition}, {fill!r}); "
                        f"the passes read a fill as masked_fill(~allowed, -inf): write the mask that way, or add "
                        f"torch.where(allowed, 0, -inf)"
                    )
                score_side, mask = scores.args[0], condition.args[0]
            if score_side is None:
                return None
            steps.append(scores)
            scores = score_side
        else:
            break
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
    steps.append(scores)
    site = _make_site(node, scores.args[0], k_read, v_read, writes, scale, mask, False, ("B", "H", "D", "S"))
    return site, [*k_read[1], *v_read[1], *steps]


def _reaches_cache(node: Node, caches: dict[Node, KVCache]) -> bool:
    """Whether ``node`` is computed from a cache's data."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in caches:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _collect_sites(gm: GraphModule, writes: dict[Node, KVWrite]) -> tuple[list[AttentionSite], set[Node]]:
    """Every attention over two caches (SDPA, or written by hand), with its mask proof;
    and the nodes those reads explain."""
    caches = {node: w.cache for node, w in writes.items()}
    sites: list[AttentionSite] = []
    explained: set[Node] = {w.node for w in writes.values()}
    for node in gm.graph.nodes:
        found = _sdpa_site(node, caches, writes) if is_sdpa(node) else _matmul_site(node, caches, writes)
        if found is not None:
            site, nodes = found
            sites.append(site)
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
        f"shard; read caches only through F.scaled_dot_product_attention or softmax(q @ k.transpose(-2, -1) * "
        f"scale + mask) @ v, directly or through layout views and a GQA head replication"
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
