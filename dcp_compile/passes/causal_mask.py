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

import torch
from torch.fx import Node

from dcp_compile.passes.fx_utils import (
    SHAPE_VIEWS, GraphPatternError, arange_bounds, arg, expand_ellipsis, fake_value, op_name, placeholder_name, shape_of,
    where,
)

CONST = ("1",)


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


class _Unsupported(Exception):
    def __init__(self, node: Node, what: str):
        super().__init__(what)
        self.node, self.what = node, what


@dataclass(frozen=True)
class _Int:
    """An integer tensor whose entry at index ``i`` is ``sum(coef * term(i))``.

    Terms: ``("ax", k)`` the index along axis ``k``; ``("in", node, dims)`` graph input
    ``node`` read at this tensor's axes ``dims`` (None: the input's unit axis); ``CONST``."""

    shape: tuple[int, ...]
    form: Mapping


@dataclass(frozen=True)
class _Atom:
    form: Mapping
    """The atom holds where ``form <= 0``."""
    node: Node

    def remapped(self, mapping, shape) -> _Atom:
        return _Atom(_prune({_remap_term(t, mapping): c for t, c in self.form.items()}, shape), self.node)


@dataclass(frozen=True)
class _KeyAtom:
    """Holds where ``table[batch, slot]`` is nonzero (false past the table's width)."""

    table: Node
    batch: Mapping
    slot: Mapping
    node: Node

    def remapped(self, mapping, shape) -> _KeyAtom:
        def move(form):
            return _prune({_remap_term(t, mapping): c for t, c in form.items()}, shape)

        return _KeyAtom(self.table, move(self.batch), move(self.slot), self.node)


@dataclass(frozen=True)
class _Bool:
    shape: tuple[int, ...]
    atoms: tuple[_Atom, ...]
    """Conjunction; empty is all-True."""


def _combine(*weighted) -> dict:
    out: dict = {}
    for coef, form in weighted:
        for term, c in form.items():
            out[term] = out.get(term, 0) + coef * c
    return {t: c for t, c in out.items() if c != 0}


def _remap_term(term, mapping):
    if term[0] == "ax":
        return ("ax", mapping[term[1]])
    if term[0] == "in":
        return ("in", term[1], tuple(None if d is None else mapping[d] for d in term[2]))
    return term


def _prune(form: Mapping, shape) -> dict:
    """Terms on unit axes read index 0: axis terms vanish, input reads lose the axis."""
    out = {}
    for term, coef in form.items():
        if term[0] == "ax" and shape[term[1]] == 1:
            continue
        if term[0] == "in":
            term = ("in", term[1], tuple(None if d is None or shape[d] == 1 else d for d in term[2]))
        out[term] = out.get(term, 0) + coef
    return out


def _reaxis(value, mapping: dict, shape):
    shape = tuple(shape)
    if isinstance(value, _Int):
        return _Int(shape, _prune({_remap_term(t, mapping): c for t, c in value.form.items()}, shape))
    return _Bool(shape, tuple(a.remapped(mapping, shape) for a in value.atoms))


def _broadcast(values, node: Node):
    try:
        shape = tuple(torch.broadcast_shapes(*(v.shape for v in values)))
    except RuntimeError:
        raise _Unsupported(node, "operands that do not broadcast") from None
    out = []
    for v in values:
        offset = len(shape) - len(v.shape)
        out.append(_reaxis(v, {k: k + offset for k in range(len(v.shape))}, shape))
    return shape, out


def _describe(form: Mapping, names=None) -> str:
    def name(term):
        if term[0] == "ax":
            return names[term[1]] if names else f"ax{term[1]}"
        if term[0] == "v":
            return term[1]
        if term[0] == "in":
            dims = ", ".join(":" if d is None else (names[d] if names and isinstance(d, int) else str(d)) for d in term[2])
            return f"{placeholder_name(term[1])}[{dims}]" if term[2] else placeholder_name(term[1])
        return "1"

    parts = []
    for term, coef in form.items():
        if term == CONST:
            parts.append(f"{coef:+d}")
        else:
            parts.append(f"{'+' if coef > 0 else '-'}{'' if abs(coef) == 1 else abs(coef)}{name(term)}")
    text = " ".join(parts).lstrip("+") or "0"
    return f"{text} <= 0"


class _Interpreter:
    def __init__(self):
        self.memo: dict[Node, object] = {}
        self.tables: list[Node] = []

    def value(self, x, node: Node):
        """The abstract value of an argument of ``node``."""
        if isinstance(x, Node):
            try:
                return self.eval(x)
            except _Unsupported as e:
                if e.node.op == "placeholder":  # name the user's line that reads the input
                    raise _Unsupported(node, e.what) from None
                raise
        if isinstance(x, bool):
            raise _Unsupported(node, f"a Python bool operand ({x})")
        if isinstance(x, int):
            return _Int((), {CONST: x} if x else {})
        raise _Unsupported(node, f"an operand {x!r}")

    def eval(self, node: Node):
        if node not in self.memo:
            self.memo[node] = self._eval(node)
        return self.memo[node]

    def _eval(self, node: Node):
        name = op_name(node)
        if node.op == "placeholder":
            value = fake_value(node)
            if isinstance(value, torch.Tensor) and value.dim() >= 3 and (value.dtype == torch.bool or value.dtype.is_floating_point):
                raise _Unsupported(node, (
                    f"graph input {placeholder_name(node)}, a {value.dim()}-D mask built outside the graph (as Hugging Face "
                    f"generate() builds one over the cache tensors' slots, which under DCP are this rank's shard). Pass a "
                    f"2-D padding mask [batch, positions] instead; for generate(), call "
                    f"dcp_compile.hf.compile_for_generate(model, group) first"))
            if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 2:
                return _key_mask_input(node, tuple(value.shape))
            if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool:
                raise _Unsupported(node, f"graph input {placeholder_name(node)} (not an integer position tensor: a padding or custom mask?)")
            shape = tuple(value.shape)
            return _Int(shape, _prune({("in", node, tuple(range(len(shape)))): 1}, shape))
        if node.op not in ("call_function", "call_method"):
            raise _Unsupported(node, f"a {node.op} node")
        out_shape = shape_of(node)
        if name == "arange":
            start, end, step = arange_bounds(node)
            if not all(isinstance(b, int) for b in (start, end, step)) or step != 1:
                raise _Unsupported(node, "torch.arange with a step or bounds that are not constant ints")
            return _Int(out_shape, _prune(_combine((1, {("ax", 0): 1}), (1, {CONST: start} if start else {})), out_shape))
        if name in ("to", "long", "int", "contiguous", "clone", "type_as", "bool", "detach"):
            base = self.value(node.args[0], node)
            dtype = fake_value(node).dtype
            if dtype == torch.bool and isinstance(base, _Int) and len(base.shape) == 2:
                table = _key_mask_table(node)
                if table is not None and base.form == {("in", table, (0, 1)): 1}:
                    return _key_mask_input(table, base.shape)  # an integer padding mask read as != 0
            if (dtype == torch.bool) != isinstance(base, _Bool) or dtype.is_floating_point:
                raise _Unsupported(node, f"a cast to {dtype}")
            return base
        if name in ("add", "sub", "neg", "mul", "radd", "rsub"):
            return self._arith(node, name, out_shape)
        if name in ("le", "lt", "ge", "gt"):
            a, b = (self.value(x, node) for x in node.args[:2])
            if not (isinstance(a, _Int) and isinstance(b, _Int)):
                raise _Unsupported(node, f"{name} of non-integer operands")
            _, (a, b) = _broadcast([a, b], node)
            diff = {"le": _combine((1, a.form), (-1, b.form)), "lt": _combine((1, a.form), (-1, b.form), (1, {CONST: 1})),
                    "ge": _combine((1, b.form), (-1, a.form)), "gt": _combine((1, b.form), (-1, a.form), (1, {CONST: 1}))}[name]
            return _Bool(out_shape, (_Atom(diff, node),))
        if name in ("and_", "logical_and", "bitwise_and", "__and__"):
            a, b = (self.value(x, node) for x in node.args[:2])
            if not (isinstance(a, _Bool) and isinstance(b, _Bool)):
                raise _Unsupported(node, "& of non-boolean operands")
            _, (a, b) = _broadcast([a, b], node)
            return _Bool(out_shape, a.atoms + b.atoms)
        if name in ("invert", "logical_not", "bitwise_not", "__invert__"):
            a = self.value(node.args[0], node)
            if not isinstance(a, _Bool) or len(a.atoms) != 1 or not isinstance(a.atoms[0], _Atom):
                raise _Unsupported(node, "negation of anything but one comparison")
            (atom,) = a.atoms
            return _Bool(out_shape, (_Atom(_combine((-1, atom.form), (1, {CONST: 1})), node),))
        if name in ("new_ones", "ones") and fake_value(node).dtype == torch.bool:
            return _Bool(out_shape, ())
        if name == "where":
            return self._additive(node, out_shape)
        if name == "pad":
            return self._right_padded(node, out_shape)
        if name in SHAPE_VIEWS or name == "getitem":
            return self._view(node, name, out_shape)
        raise _Unsupported(node, f"{name or node.target!r}, an op the mask prover does not model")

    def _arith(self, node, name, out_shape):
        if name == "neg":
            a = self.value(node.args[0], node)
            operands = [(-1, a)]
        else:
            a, b = (self.value(x, node) for x in node.args[:2])
            if name == "mul":
                scalar = [v for v in (a, b) if isinstance(v, _Int) and set(v.form) <= {CONST}]
                if not scalar or not (isinstance(a, _Int) and isinstance(b, _Int)):
                    raise _Unsupported(node, "a product of two index tensors")
                k = scalar[0].form.get(CONST, 0)
                other = b if scalar[0] is a else a
                operands = [(k, other)]
            else:
                sign = {"add": (1, 1), "radd": (1, 1), "sub": (1, -1), "rsub": (-1, 1)}[name]
                operands = [(sign[0], a), (sign[1], b)]
        if not all(isinstance(v, _Int) for _, v in operands):
            raise _Unsupported(node, f"{name} of boolean tensors")
        _, aligned = _broadcast([v for _, v in operands], node)
        return _Int(out_shape, _combine(*((c, v.form) for (c, _), v in zip(operands, aligned))))

    def _additive(self, node, out_shape):
        """``torch.where(allowed, 0, -inf)``: an additive float mask equal to a boolean one."""
        cond, keep, drop = (arg(node, i, n) for i, n in enumerate(("condition", "input", "other")))
        # Hugging Face's eager mask keeps with a zero scalar tensor: torch.zeros((), dtype=...)
        # from transformers 5.24 on, torch.tensor(0.0, dtype=...) before.
        if isinstance(keep, Node) and tuple(fake_value(keep).shape) == () and (
            op_name(keep) == "zeros" or (op_name(keep) == "tensor" and keep.args[:1] in ((0,), (0.0,)))
        ):
            keep = 0
        if not (isinstance(keep, (int, float)) and keep == 0 and isinstance(drop, (int, float)) and drop <= -1e4):
            raise _Unsupported(node, "torch.where other than where(allowed, 0, -inf)")
        base = self.value(cond, node)
        if not isinstance(base, _Bool):
            raise _Unsupported(node, "torch.where over a non-boolean condition")
        offset = len(out_shape) - len(base.shape)
        return _reaxis(base, {k: k + offset for k in range(len(base.shape))}, out_shape)

    def _right_padded(self, node, out_shape):
        """``F.pad(mask, (0, p))`` of a computed boolean mask (transformers' padding of a
        mask narrower than the keys): False past the old width ``W`` of the last axis,
        the atom ``ax - (W - 1) <= 0``."""
        widths, mode, value = arg(node, 1, "pad"), arg(node, 2, "mode", "constant"), arg(node, 3, "value", None)
        base = self.value(node.args[0], node)
        if (not isinstance(base, _Bool) or mode != "constant" or value not in (None, 0, False) or len(widths) != 2
                or widths[0] != 0):
            raise _Unsupported(node, "a pad other than a boolean mask right-padded with False along its last axis")
        last = len(out_shape) - 1
        padded = _reaxis(base, {k: k for k in range(len(base.shape))}, out_shape)
        if widths[1] == 0:
            return padded
        edge = _Atom(_prune({("ax", last): 1, CONST: 1 - base.shape[-1]}, out_shape), node)
        return _Bool(out_shape, padded.atoms + (edge,))

    def _view(self, node, name, out_shape):
        source = node.args[0]
        if name == "getitem" and isinstance(source, Node):
            index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            tensors = [e for e in index if isinstance(e, Node)]
            key_table = _key_mask_table(source)
            if len(tensors) == 2 and len(index) == 2 and key_table is not None:
                return self._key_mask_lookup(node, key_table, index, out_shape)
            if tensors and source.op == "placeholder":
                return self._table_lookup(node, source, index, out_shape)
            if tensors and len(tensors) == len(index):
                return self._gather(node, self.value(source, node), index, out_shape)
        base = self.value(source, node)
        in_shape = base.shape
        if name == "getitem":
            index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            index = expand_ellipsis(index, len(in_shape))
            mapping, out_axis, in_axis = {}, 0, 0
            for entry in index:
                if entry is None:
                    out_axis += 1
                elif isinstance(entry, slice) and entry == slice(None):
                    mapping[in_axis] = out_axis
                    in_axis, out_axis = in_axis + 1, out_axis + 1
                else:
                    raise _Unsupported(node, f"indexing with {entry!r} (only None, : and ... are modelled)")
            for rest in range(in_axis, len(in_shape)):
                mapping[rest] = out_axis + rest - in_axis
            return _reaxis(base, mapping, out_shape)
        if name == "expand":
            offset = len(out_shape) - len(in_shape)
            for k, n in enumerate(in_shape):
                if n != 1 and out_shape[k + offset] != n:
                    raise _Unsupported(node, "an expand that changes a non-unit axis")
            return _reaxis(base, {k: k + offset for k in range(len(in_shape))}, out_shape)
        # unsqueeze / squeeze / view / reshape / flatten: only unit axes may come or go.
        keep_in = [k for k, n in enumerate(in_shape) if n != 1]
        keep_out = [k for k, n in enumerate(out_shape) if n != 1]
        if [in_shape[k] for k in keep_in] != [out_shape[k] for k in keep_out]:
            raise _Unsupported(node, f"a {name} from {list(in_shape)} to {list(out_shape)} that merges or splits axes")
        mapping = dict(zip(keep_in, keep_out))
        mapping.update({k: None for k in range(len(in_shape)) if k not in mapping})
        return _reaxis(base, mapping, out_shape)

    def _gather(self, node, base, index: tuple, out_shape):
        """``x[i_0, ..., i_{r-1}]`` of a computed tensor ``x`` by one integer tensor per
        axis: entry ``o`` is ``x[i_0[o], ...]``, so axis ``k``'s term becomes ``i_k``'s
        form.  An input read along axis ``k`` stays a read along one axis only where
        ``i_k`` is exactly one axis of the result."""
        if len(index) != len(base.shape):
            raise _Unsupported(node, f"advanced indexing of a {len(base.shape)}-D tensor with {len(index)} index tensors")
        indices = [self.value(e, node) for e in index]
        if not all(isinstance(v, _Int) for v in indices):
            raise _Unsupported(node, "advanced indexing with non-integer tensors")
        _, indices = _broadcast(indices, node)
        offset = len(out_shape) - len(indices[0].shape)
        forms = [_reaxis(v, {k: k + offset for k in range(len(v.shape))}, out_shape).form for v in indices]

        def axis_of(k: int, input_node: Node, dim: int):
            form = forms[k]
            ((term, coef),) = form.items() if len(form) == 1 else ((None, None),)
            if term is not None and term[0] == "ax" and coef == 1:
                return term[1]
            if not form and fake_value(input_node).shape[dim] == 1:
                return None
            raise _Unsupported(node, (
                f"advanced indexing that reads graph input {placeholder_name(input_node)} at "
                f"{_describe_index(form)} (only a plain axis of the result is modelled)"))

        def substitute(form: Mapping) -> dict:
            out: dict = {}
            for term, coef in form.items():
                if term[0] == "ax":
                    pieces = [(coef, forms[term[1]])]
                elif term[0] == "in":
                    dims = tuple(None if d is None else axis_of(d, term[1], j) for j, d in enumerate(term[2]))
                    pieces = [(coef, {("in", term[1], dims): 1})]
                else:
                    pieces = [(coef, {term: 1})]
                out = _combine((1, out), *pieces)
            return _prune(out, out_shape)

        if isinstance(base, _Int):
            return _Int(out_shape, substitute(base.form))
        atoms = []
        for a in base.atoms:
            if isinstance(a, _KeyAtom):
                atoms.append(_KeyAtom(a.table, substitute(a.batch), substitute(a.slot), a.node))
            else:
                atoms.append(_Atom(substitute(a.form), a.node))
        return _Bool(out_shape, tuple(atoms))

    def _key_mask_lookup(self, node, table: Node, index: tuple, out_shape):
        """``pad[batch_idx, slot_idx]``: a key-padding read; proven only if the indices
        turn out to be the batch and the slot axes."""
        rows, slots = (self.value(e, node) for e in index)
        if not (isinstance(rows, _Int) and isinstance(slots, _Int)):
            raise _Unsupported(node, f"indexing {placeholder_name(table)} with non-integer tensors")
        _, (rows, slots) = _broadcast([rows, slots], node)
        offset = len(out_shape) - len(rows.shape)
        rows, slots = (_reaxis(v, {k: k + offset for k in range(len(v.shape))}, out_shape) for v in (rows, slots))
        return _Bool(out_shape, (_KeyAtom(table, rows.form, slots.form, node),))

    def _table_lookup(self, node, table: Node, index: tuple, out_shape):
        """``table[None, ..., positions, ...]`` of a 2-D table [P, S]: row ``positions``."""
        value = fake_value(table)
        if value.dim() != 2 or not (value.dtype == torch.bool or value.dtype.is_floating_point):
            raise _Unsupported(node, f"indexing graph input {placeholder_name(table)} of shape {tuple(value.shape)} "
                                     f"(a causal-mask table is a 2-D [positions, slots] bool or additive tensor)")
        tensors = [i for i, e in enumerate(index) if isinstance(e, Node)]
        real = [e for e in index if e is not None]
        if len(tensors) != 1 or real[0] is not index[tensors[0]] or any(
            not (isinstance(e, slice) and e == slice(None)) for e in real[1:]
        ):
            raise _Unsupported(node, f"indexing table {placeholder_name(table)} other than table[..., positions, :]")
        rows = self.value(index[tensors[0]], node)
        if not isinstance(rows, _Int):
            raise _Unsupported(node, "a table row index that is not an integer tensor")
        leading = sum(1 for e in index[: tensors[0]] if e is None)
        trailing = sum(1 for e in index[tensors[0] + 1 :] if e is None)
        if trailing:
            raise _Unsupported(node, "unit axes after the table's row index")
        rows = _reaxis(rows, {k: k + leading for k in range(len(rows.shape))}, out_shape[:-1])
        slot_axis = len(out_shape) - 1
        self.tables.append(table)
        form = _prune(_combine((1, {("ax", slot_axis): 1}), (-1, rows.form)), out_shape)
        return _Bool(out_shape, (_Atom(form, node),))


def _key_mask_input(table: Node, shape) -> _Bool:
    """A 2-D mask input ``[B, W]`` as a key-padding atom over its own two axes."""
    return _Bool(shape, (_KeyAtom(table, _prune({("ax", 0): 1}, shape), _prune({("ax", 1): 1}, shape), table),))


_PASS_THROUGH = frozenset({"to", "bool", "contiguous", "clone", "detach"})


def _key_mask_table(node: Node) -> Node | None:
    """The 2-D graph input a padding-mask read reads from: through casts (to bool, or
    keeping an integer dtype) and right-padding of its last axis with zeros; None for
    anything else."""
    while node.op != "placeholder":
        name = op_name(node)
        if name in _PASS_THROUGH:
            value = fake_value(node)
            if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point:
                return None
            node = node.args[0]
        elif name == "pad":
            widths, mode, value = arg(node, 1, "pad"), arg(node, 2, "mode", "constant"), arg(node, 3, "value", None)
            if mode != "constant" or value not in (None, 0, False) or tuple(widths)[:1] != (0,) or len(widths) != 2:
                return None
            node = node.args[0]
        else:
            return None
        if not isinstance(node, Node):
            return None
    value = fake_value(node)
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.dtype.is_floating_point:
        return None
    return node


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
    if mask is None:
        if is_causal:
            return MaskProof(failure=(
                f"attention over a KV cache at {where_site} uses is_causal=True, which aligns the causal mask to cache "
                f"slot 0, not to the tokens' positions; pass attn_mask=(slots <= positions) instead"))
        return MaskProof(failure=(
            f"attention over a KV cache at {where_site} has no mask, so it reads every cache slot, including slots no "
            f"token has written; mask it with slots <= the query's position"))
    if not isinstance(mask, Node):
        return MaskProof(failure=f"attention over a KV cache at {where_site} has a constant mask {mask!r}")
    interpreter = _Interpreter()
    try:
        value = interpreter.eval(mask)
        write = interpreter.eval(positions)
    except _Unsupported as e:
        return MaskProof(failure=(
            f"the attention mask at {where_site} is built from {e.what} at {where(e.node)}; the passes cannot prove it "
            f"is the position-causal mask (keys at positions <= the query's), so the attention cannot be sharded"))
    except GraphPatternError as e:
        return MaskProof(failure=f"the attention mask at {where_site} could not be analysed: {e}")
    if not isinstance(value, _Bool) or not isinstance(write, _Int) or len(value.shape) > 4:
        return MaskProof(failure=f"the attention mask at {where_site} is not a boolean (or where(allowed, 0, -inf)) mask")
    mask_names = score_axes[4 - len(value.shape):]
    offset = len(position_tags) - len(write.shape)
    write_names = [_TAG_NAMES.get(position_tags[offset + k]) for k in range(len(write.shape))]
    if any(n is None for t in write.form for n in ([write_names[t[1]]] if t[0] == "ax" else [])):
        return MaskProof(failure=f"the KV write positions feeding {where_site} vary along an axis that is neither batch nor token")
    expected = _combine((1, {("v", "s"): 1}), (-1, _canonical(write.form, write_names)))
    key_atoms = [a for a in value.atoms if isinstance(a, _KeyAtom)]
    for a in key_atoms:
        batch, slot = _canonical(a.batch, mask_names), _canonical(a.slot, mask_names)
        one_row = fake_value(a.table).shape[0] == 1  # a batch of one reads row 0 whatever the index
        if batch not in ({("v", "b"): 1},) + (({},) if one_row else ()) or slot != {("v", "s"): 1}:
            return MaskProof(failure=(
                f"the attention mask at {where_site} reads the padding mask {placeholder_name(a.table)} at "
                f"[{_describe_index(batch)}, {_describe_index(slot)}] at {where(a.node)}; a key-padding mask is sharded "
                f"only when read at [b, s] (sequence, cache slot)"))
    atoms = [(a, _canonical(a.form, mask_names)) for a in value.atoms if isinstance(a, _Atom) and a.form]
    causal = [a for a, form in atoms if form == expected]
    classified = [(a, None if form == expected else _lower_bound(form)) for a, form in atoms if form != expected]
    bounds = [bound for _, bound in classified if bound is not None]
    extra = [a for a, bound in classified if bound is None]
    if not causal:
        found = "; ".join(f"{_describe(f)} at {where(a.node)}" for a, f in atoms) or "no condition at all"
        return MaskProof(failure=(
            f"the attention mask at {where_site} is not the position-causal mask {_describe(expected)} "
            f"(slot s, write positions of this layer); found {found}"))
    if extra:
        found = "; ".join(f"{_describe(f)} at {where(a.node)}" for a, f in ((a, _canonical(a.form, mask_names)) for a in extra))
        return MaskProof(failure=(
            f"the attention mask at {where_site} restricts the causal mask further: {found} (s: cache slot, t: new "
            f"token). Sliding-window and chunked masks are not supported under DCP, which shards full causal "
            f"attention; padding is, as a 2-D key mask read at [b, s] or as a per-row lower bound s >= lo[b]"))
    return MaskProof(tables=tuple(dict.fromkeys(interpreter.tables)),
                     key_masks=tuple(dict.fromkeys(a.table for a in key_atoms)),
                     key_lower_bounds=tuple(dict.fromkeys(bounds)))


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


def _describe_index(form: Mapping) -> str:
    return _describe(form).removesuffix(" <= 0")
