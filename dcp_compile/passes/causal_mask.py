"""Prove that an attention mask over a KV cache is the position-causal one.

The cascade (``shard_attention``) drops the user's mask and lets new token ``t`` of
sequence ``b`` see cache slot ``s`` exactly when ``s <= pos[b, t]``, where ``pos`` is what
the same layer's KV write stores.  That rewrite is faithful only if the user's mask *is*
that predicate, so this module proves it, by abstract interpretation of the FX nodes
that build the mask:

- an integer tensor is a linear form over its own axis indices, the graph's integer
  inputs (indexed by those axes) and a constant: ``torch.arange(S)[None, :]`` is
  ``ax1``, ``torch.arange(T) + cache_len`` is ``ax0 + cache_len[]``;
- a boolean tensor is a conjunction of atoms ``form <= 0`` (integer semantics, so
  ``a < b`` is ``a - b + 1 <= 0``);
- a key-padding read ``pad[b_idx, s_idx]`` of a 2-D graph input ``[B, W]`` (bool, or
  integer read as ``!= 0``; right-padded with zeros, as HF's ``prepare_padding_mask``
  does) is an atom of its own, true where the entry is;
- views, broadcasts, ``&`` and ``~`` transform those symbolically;
- a tensor the graph computes and then reads by advanced indexing
  (``mask[batch_idx, kv_idx]``, as transformers' ``padding_mask_function`` reads the
  2-D mask it is given) is that tensor's forms with its axes replaced by the index forms.

The mask is proven when it is, up to broadcasting to ``[B, H, T, S]``, the atom
``s - pos[b, t] <= 0`` with ``pos`` the write's own positions form, and-ed with any
number of

- key-padding atoms read at exactly ``[b, s]``: a key mask over global positions, which
  the cascade shards like the cache (``MaskProof.key_masks``), read by the masked
  reference attention;
- per-row lower bounds ``lo[b] + c - s <= 0`` (``s >= lo[b] + c``, with ``lo`` integer
  graph inputs read along the batch axis only): a left-padding mask, whose pad
  positions come first in every row, in the one form that says so in the graph
  (``MaskProof.key_lower_bounds``); the cascade hands the bound to the same length-bounded
  kernels as an unmasked site.  A 2-D mask *table* never becomes a bound, whatever it
  holds: its zeros being a prefix of each row is a fact about the data, which a graph
  cannot prove; it stays a key mask.

Anything else stays unproven, with a reason naming the node and the user's source
line: a padding mask indexed otherwise, a sliding window or an upper bound (an extra
atom that is not a lower bound per row), a union of masks, a mask built by vmap or any
op not modelled here, ``is_causal=True`` (aligned to slot 0, not to positions), or no
mask at all (every slot, written or not, would be visible).

A causal-mask *table* indexed by positions (gpt-fast's
``causal_mask[None, None, input_pos]``) is proven under the assumption that the table
is lower triangular (``table[p, s] == (s <= p)``); the proof records the table
(``MaskProof.tables``) and ``dcp.prepare`` checks the assumption on the real tensor.

Nothing here modifies the graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from torch.fx import Node

from dcp_compile.passes.fx_utils import GraphPatternError, fake_value, placeholder_name, where
from dcp_compile.passes.mask_interpreter import (
    CONST, Atom, Bool, Int, Interpreter, KeyAtom, Unsupported, combine, describe, describe_index,
)


@dataclass(frozen=True)
class MaskProof:
    """What ``prove_causal`` established about one attention site's mask."""

    tables: tuple[Node, ...] = ()
    """Placeholders of causal-mask tables the proof assumes lower triangular."""
    key_masks: tuple[Node, ...] = ()
    """Placeholders ``[B, W]`` of key-padding masks over global positions, and-ed with
    the causal mask: key ``s`` of sequence ``b`` is visible only where ``mask[b, s]``
    (positions ``>= W`` are not)."""
    key_lower_bounds: tuple[KeyLowerBound, ...] = ()
    """Per-row lower bounds on the visible key positions, and-ed with the causal mask
    (and any key masks): key ``s`` of sequence ``b`` is visible only where
    ``s >= bound[b]`` for every bound."""
    failure: str | None = None
    """Why the mask is not proven position-causal; None when it is."""

    @property
    def proven(self) -> bool:
        return self.failure is None


@dataclass(frozen=True)
class KeyLowerBound:
    """``s >= sum(coef * input.reshape(-1)) + const`` for sequence ``b``: each input an
    integer graph input whose only non-unit axis (if any) is the batch axis."""

    inputs: tuple[tuple[Node, int], ...]
    """``(placeholder, coefficient)`` pairs."""
    const: int = 0


_MASK_AXES = "bhts"
_TAG_NAMES = MappingProxyType({"B": "b", "T": "t"})


def _canonical(form: Mapping, names) -> dict:
    def rename(term):
        if term[0] == "ax":
            return ("v", names[term[1]])
        if term[0] == "in":
            return ("in", term[1], tuple(None if d is None else names[d] for d in term[2]))
        return term

    return {rename(t): c for t, c in form.items()}


def prove_causal(site: Node, mask, is_causal, positions: Node, position_tags: tuple[str, ...],
                 score_axes: str = _MASK_AXES) -> MaskProof:
    """Whether the attention ``site`` with ``attn_mask=mask`` lets new token ``t`` of
    sequence ``b`` see exactly the cache slots ``s <= positions[b, t]``.

    ``positions`` is the node the layer's KV write stores at, broadcast along
    ``position_tags`` (``B``, ``T`` or ``1`` per axis, as ``kv_index.analyse_write`` found).
    ``score_axes``: what the axes of the scores the mask is broadcast against hold
    (``"bhts"`` for SDPA; ``"bths"`` for scores laid out tokens before heads)."""
    where_site = where(site)
    if not isinstance(mask, Node):
        return MaskProof(failure=_unmasked_failure(where_site, mask, is_causal))
    interpreter = Interpreter()
    try:
        value = interpreter.eval(mask)
        write = interpreter.eval(positions)
    except Unsupported as e:
        return MaskProof(failure=(
            f"the attention mask at {where_site} is built from {e.what} at {where(e.node)}; the passes cannot prove it "
            f"is the position-causal mask (keys at positions <= the query's), so the attention cannot be sharded"))
    except GraphPatternError as e:
        return MaskProof(failure=f"the attention mask at {where_site} could not be analysed: {e}")
    if not isinstance(value, Bool) or not isinstance(write, Int) or len(value.shape) > 4:
        return MaskProof(failure=f"the attention mask at {where_site} is not a boolean (or where(allowed, 0, -inf)) mask")
    mask_names = score_axes[4 - len(value.shape):]
    expected = _causal_form(write, position_tags)
    if expected is None:
        return MaskProof(failure=f"the KV write positions feeding {where_site} vary along an axis that is neither batch nor token")
    key_atoms = [a for a in value.atoms if isinstance(a, KeyAtom)]
    failure = _key_mask_failure(where_site, key_atoms, mask_names)
    if failure is not None:
        return MaskProof(failure=failure)
    bounds, failure = _causal_with_bounds(where_site, value.atoms, expected, mask_names)
    if failure is not None:
        return MaskProof(failure=failure)
    return MaskProof(tables=tuple(dict.fromkeys(interpreter.tables)),
                     key_masks=tuple(dict.fromkeys(a.table for a in key_atoms)),
                     key_lower_bounds=tuple(dict.fromkeys(bounds)))


def _unmasked_failure(where_site: str, mask, is_causal) -> str:
    """Why a site whose mask is no graph tensor (none, or a constant) is not proven."""
    if mask is None and is_causal:
        return (f"attention over a KV cache at {where_site} uses is_causal=True, which aligns the causal mask to cache "
                f"slot 0, not to the tokens' positions; pass attn_mask=(slots <= positions) instead")
    if mask is None:
        return (f"attention over a KV cache at {where_site} has no mask, so it reads every cache slot, including slots no "
                f"token has written; mask it with slots <= the query's position")
    return f"attention over a KV cache at {where_site} has a constant mask {mask!r}"


def _causal_form(write: Int, position_tags: tuple[str, ...]) -> dict | None:
    """The causal atom ``s - pos[b, t] <= 0`` over the write's positions form, in the
    mask's axis names; None if the positions vary along an axis other than batch and token."""
    offset = len(position_tags) - len(write.shape)
    write_names = [_TAG_NAMES.get(position_tags[offset + k]) for k in range(len(write.shape))]
    if any(n is None for t in write.form for n in ([write_names[t[1]]] if t[0] == "ax" else [])):
        return None
    return combine((1, {("v", "s"): 1}), (-1, _canonical(write.form, write_names)))


def _key_mask_failure(where_site: str, key_atoms: list[KeyAtom], mask_names: str) -> str | None:
    """Why a key-padding read is not the ``[b, s]`` one the cascade shards; None if all are."""
    for a in key_atoms:
        batch, slot = _canonical(a.batch, mask_names), _canonical(a.slot, mask_names)
        one_row = fake_value(a.table).shape[0] == 1  # a batch of one reads row 0 whatever the index
        if batch not in ({("v", "b"): 1},) + (({},) if one_row else ()) or slot != {("v", "s"): 1}:
            return (
                f"the attention mask at {where_site} reads the padding mask {placeholder_name(a.table)} at "
                f"[{describe_index(batch)}, {describe_index(slot)}] at {where(a.node)}; a key-padding mask is sharded "
                f"only when read at [b, s] (sequence, cache slot)")
    return None


def _causal_with_bounds(where_site: str, all_atoms, expected: dict,
                        mask_names: str) -> tuple[list[KeyLowerBound], str | None]:
    """The mask's comparison atoms as the causal atom and-ed with per-row lower bounds:
    ``(bounds, None)``, or ``([], why not)`` when the causal atom is missing or another
    atom restricts it further."""
    atoms = [(a, _canonical(a.form, mask_names)) for a in all_atoms if isinstance(a, Atom) and a.form]
    causal = [a for a, form in atoms if form == expected]
    classified = [(a, None if form == expected else _lower_bound(form)) for a, form in atoms if form != expected]
    bounds = [bound for _, bound in classified if bound is not None]
    extra = [a for a, bound in classified if bound is None]
    if not causal:
        found = "; ".join(f"{describe(f)} at {where(a.node)}" for a, f in atoms) or "no condition at all"
        return [], (
            f"the attention mask at {where_site} is not the position-causal mask {describe(expected)} "
            f"(slot s, write positions of this layer); found {found}")
    if extra:
        found = "; ".join(f"{describe(f)} at {where(a.node)}" for a, f in ((a, _canonical(a.form, mask_names)) for a in extra))
        return [], (
            f"the attention mask at {where_site} restricts the causal mask further: {found} (s: cache slot, t: new "
            f"token). Sliding-window and chunked masks are not supported under DCP, which shards full causal "
            f"attention; padding is, as a 2-D key mask read at [b, s] or as a per-row lower bound s >= lo[b]")
    return bounds, None


def _lower_bound(form: Mapping) -> KeyLowerBound | None:
    """``form <= 0`` as ``s >= bound[b]`` when it is ``F(b) - s <= 0``: ``F`` a constant plus
    integer inputs read along the batch axis only (nothing that varies with the token,
    the head or the slot); None for any other atom."""
    if form.get(("v", "s")) != -1:
        return None
    inputs, const = [], 0
    for term, coef in form.items():
        if term == ("v", "s"):
            continue
        if term == CONST:
            const = coef
        elif term[0] == "in" and all(d in (None, "b") for d in term[2]) and sum(d == "b" for d in term[2]) <= 1:
            inputs.append((term[1], coef))
        else:
            return None
    return KeyLowerBound(tuple(inputs), const)
