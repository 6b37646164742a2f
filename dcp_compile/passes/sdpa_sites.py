"""Attention sites spelled ``F.scaled_dot_product_attention``: over two caches, over keys
and values computed from caches, or MLA's latent form (keys ``cat([latent, rope_key])``,
values the latent itself).  Part of ``find``; never modifies the graph.
"""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet

from torch.fx import Node

from dcp_compile.passes.cache_reads import expanded_site, make_site, read_chain
from dcp_compile.passes.causal_mask import prove_causal
from dcp_compile.passes.fx_utils import LAYOUT_ONLY, GraphPatternError, arg, op_name, shape_of, where
from dcp_compile.passes.plan import AttentionSite, KVCache, KVWrite, LatentParts


def _sdpa_scale(node: Node) -> float:
    """An SDPA call's softmax scale: its ``scale``, else ``1 / sqrt(query width)``."""
    scale = arg(node, 6, "scale", None)
    return float(scale) if scale is not None else 1.0 / math.sqrt(shape_of(node.args[0])[-1])


def _refuse_sdpa_dropout(node: Node) -> None:
    if arg(node, 4, "dropout_p", 0.0):
        raise GraphPatternError(f"attention at {where(node)} uses dropout; dcp-compile compiles inference graphs")


def sdpa_site(node: Node, caches: dict[Node, KVCache], writes: dict[Node, KVWrite], earlier: AbstractSet[Node]):
    """An ``F.scaled_dot_product_attention`` over two caches, or None if it reads none."""
    q, k, v = node.args[:3]
    reads = [read_chain(operand, caches) for operand in (k, v)]
    if reads[0] is None and reads[1] is not None:
        latent = _latent_sdpa_site(node, caches, writes, reads[1])
        if latent is not None:
            return latent
    scale = _sdpa_scale(node)
    if any(r is None for r in reads):
        # Not two cache reads: keys and values computed from caches, or no cache at all.
        found = expanded_site(node, q, k, v, caches, writes, scale, arg(node, 3, "attn_mask"),
                               arg(node, 5, "is_causal", False), earlier, keys_transposed=False)
        if found is not None:
            _refuse_sdpa_dropout(node)
        return found
    _refuse_sdpa_dropout(node)
    site = make_site(node, q, *reads, writes, scale, arg(node, 3, "attn_mask"), arg(node, 5, "is_causal", False))
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
