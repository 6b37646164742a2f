"""Attention written by hand: ``softmax(q @ k.transpose(-2, -1) * scale + mask) @ v``
(``matmul_site``), and MLA's absorbed attention as einsums over a latent and a rope-key
cache (``einsum_site``).  The site is the product with the values; the walk back from it
takes off the casts, the scale and the mask to reach the scores.  Part of ``find``;
never modifies the graph.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from torch.fx import Node

from dcp_compile.passes.cache_reads import expanded_site, make_site, read_chain
from dcp_compile.passes.causal_mask import MaskProof, prove_causal
from dcp_compile.passes.fx_utils import GraphPatternError, arg, op_name, shape_of, where
from dcp_compile.passes.plan import AttentionSite, KVCache, KVWrite, LatentParts
from dcp_compile.passes.slotwise import reads_cache

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


def matmul_site(node: Node, caches: dict[Node, KVCache], writes: dict[Node, KVWrite], earlier: AbstractSet[Node]):
    """Attention written by hand over two caches: ``softmax(q @ k.transpose(-2, -1) *
    scale + mask) @ v`` (nanoGPT, Hugging Face eager, reference code), with the scale a
    constant factor or divisor anywhere on the scores, the mask added (``where(allowed,
    0, -inf)``) or filled (``masked_fill(~allowed, -inf)``), and casts (and an inactive
    dropout) around the softmax.  ``node`` is the product with the values; None if it is
    not one over a cache."""
    if op_name(node) not in _MATMULS or len(node.args) != 2:
        return None
    v_read = read_chain(node.args[1], caches)
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
        found = expanded_site(node, scores.args[0], scores.args[1], node.args[1], caches, writes, scale, mask,
                               False, earlier, keys_transposed=True, scores=scores)
        return None if found is None else (found[0], [*found[1], *prob_steps, *score_steps, scores])
    if op_name(scores) not in _MATMULS or len(scores.args) != 2:
        raise GraphPatternError(
            f"the softmax at {where(probs)} over values of KV cache {v_read[0].name} is taken of "
            f"{op_name(scores) if isinstance(scores, Node) else scores!r} at {where(scores) if isinstance(scores, Node) else '?'}, "
            f"not of q @ k.transpose(-2, -1) (times a constant, plus a mask)"
        )
    k_read = read_chain(scores.args[1], caches)
    if k_read is None:
        raise GraphPatternError(
            f"the scores at {where(scores)} are not taken against a KV cache's keys, but the softmax over them "
            f"weighs the values of KV cache {v_read[0].name}"
        )
    site = make_site(node, scores.args[0], k_read, v_read, writes, scale, mask, False, ("B", "H", "D", "S"))
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


def _einsum_value_product(node: Node, caches: dict[Node, KVCache]):
    """``node`` as ``einsum("bths,bsc->bthc", probs, cache)`` over a ``[B, S, C]`` cache:
    ``(probs subscripts, the cache, the softmax, the steps back to it)``, or None if it is
    no product of a softmax with a cache."""
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
    probs, prob_steps = peeled
    b, s_letter, c = c_sub
    if caches[value].seq_dim != 1 or p_sub[0] != b or p_sub[-1] != s_letter or out_sub != p_sub[:-1] + c:
        raise GraphPatternError(
            f"the value product at {where(node)} ({node.args[0]!r}) is not probs[b, ., ., s] x cache[b, s, c] summed "
            f"over s; the passes shard MLA's absorbed attention written that way"
        )
    return p_sub, value, probs, prob_steps


def _latent_score_terms(node: Node, scores: Node, probs: Node, p_sub: str, value: Node,
                        caches: dict[Node, KVCache]):
    """The score terms of an absorbed attention, checked: ``(terms, the latent term, the
    rope terms)``, one term over the value cache, at most one over another cache, every
    term's axes laid out as the value product's."""
    value_cache = caches[value]
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
    score_sub = latent[0][3]
    if score_sub[:3] != p_sub[:3] or any(f[3][:3] != score_sub[:3] for f in found):
        raise GraphPatternError(f"the score terms at {where(scores)} and the value product at {where(node)} lay out their axes differently")
    return terms, latent[0], rope


def _token_axis(node: Node, mask, write: KVWrite, sizes: dict[str, int], letters: str) -> tuple[int, MaskProof]:
    """Which of the two middle score axes holds the new tokens (0 or 1), with the mask's
    proof read that way: the axis as long as the write's tokens; where both are, the
    one whose mask proves causal."""
    candidates = [i for i, letter in enumerate(letters) if sizes[letter] == write.index.tokens] or [0, 1]
    proofs = []
    for t_axis in candidates:
        axes = "b" + ("th" if t_axis == 0 else "ht") + "s"
        proofs.append((t_axis, prove_causal(node, mask, False, write.positions, write.index.position_tags, axes)))
    return next(((t, p) for t, p in proofs if p.proven), proofs[0])


def einsum_site(node: Node, caches: dict[Node, KVCache], writes: dict[Node, KVWrite]):
    """MLA's absorbed attention (DeepSeek's ``attn_impl == "absorb"`` decode)::

        scores = (einsum("bthc,bsc->bths", q_lat, kv_cache)
                  + einsum("bthr,bsr->bths", q_pe, pe_cache)) * scale
        probs  = softmax(scores masked, dim=-1)
        o_lat  = einsum("bths,bsc->bthc", probs, kv_cache)      # ``node``

    with the caches ``[B, S, C]`` and ``[B, S, R]`` written at one position tensor.
    Any letters and any order of the token and head axes; None if ``node`` is not the
    value product of such an attention."""
    product = _einsum_value_product(node, caches)
    if product is None:
        return None
    p_sub, value, probs, prob_steps = product
    scores, scale, mask, score_steps = _peel_scores(probs, caches)
    terms, (_, q_latent, q_sub, score_sub), rope = _latent_score_terms(node, scores, probs, p_sub, value, caches)
    latent_write = writes[value]
    t_axis, proof = _token_axis(node, mask, latent_write, dict(zip(q_sub, shape_of(q_latent))), score_sub[1:3])
    h_axis = 1 - t_axis
    query_perm = (0, 1 + h_axis, 1 + t_axis, 3)
    out_perm = tuple(query_perm.index(i) for i in range(4))
    rope_write, rope_query = (writes[rope[0][0].node], rope[0][1]) if rope else (None, None)
    if rope_write is not None and rope_write.positions is not latent_write.positions:
        raise GraphPatternError(
            f"the latent and rope-key caches read at {where(scores)} are written at different position tensors "
            f"({where(latent_write.node)} and {where(rope_write.node)}); expected one positions tensor per layer"
        )
    if rope_write is None:
        raise GraphPatternError(f"the latent attention at {where(node)} has no rope-key term; the passes shard MLA's latent + rope form")
    parts = LatentParts(rope_query, rope_write, query_perm, out_perm)
    site = AttentionSite(node, q_latent, latent_write, latent_write, scale, proof, parts)
    term_nodes = terms + ([scores] if len(terms) == 2 else [])
    return site, [node, *prob_steps, *score_steps, *term_nodes]
