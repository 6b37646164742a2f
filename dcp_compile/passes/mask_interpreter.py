"""The abstract interpreter ``causal_mask.prove_causal`` runs over the FX nodes that build
a mask (the domain is described there): an integer tensor is a linear form over its
axis indices, integer graph inputs and a constant (``Int``); a boolean tensor is a
conjunction of atoms, ``form <= 0`` (``Atom``) or a key-padding read (``KeyAtom``)
(``Bool``).  An op it does not model raises ``Unsupported`` naming the node.

Nothing here modifies the graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.fx import Node

from dcp_compile.passes.fx_utils import (
    SHAPE_VIEWS, arange_bounds, arg, expand_ellipsis, fake_value, op_name, placeholder_name, shape_of,
)

CONST = ("1",)


class Unsupported(Exception):
    def __init__(self, node: Node, what: str):
        super().__init__(what)
        self.node, self.what = node, what


@dataclass(frozen=True)
class Int:
    """An integer tensor whose entry at index ``i`` is ``sum(coef * term(i))``.

    Terms: ``("ax", k)`` the index along axis ``k``; ``("in", node, dims)`` graph input
    ``node`` read at this tensor's axes ``dims`` (None: the input's unit axis); ``CONST``."""

    shape: tuple[int, ...]
    form: Mapping


@dataclass(frozen=True)
class Atom:
    form: Mapping
    """The atom holds where ``form <= 0``."""
    node: Node

    def remapped(self, mapping, shape) -> Atom:
        return Atom(_prune({_remap_term(t, mapping): c for t, c in self.form.items()}, shape), self.node)


@dataclass(frozen=True)
class KeyAtom:
    """Holds where ``table[batch, slot]`` is nonzero (false past the table's width)."""

    table: Node
    batch: Mapping
    slot: Mapping
    node: Node

    def remapped(self, mapping, shape) -> KeyAtom:
        def move(form):
            return _prune({_remap_term(t, mapping): c for t, c in form.items()}, shape)

        return KeyAtom(self.table, move(self.batch), move(self.slot), self.node)


@dataclass(frozen=True)
class Bool:
    shape: tuple[int, ...]
    atoms: tuple[Atom, ...]
    """Conjunction; empty is all-True."""


def combine(*weighted) -> dict:
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
    if isinstance(value, Int):
        return Int(shape, _prune({_remap_term(t, mapping): c for t, c in value.form.items()}, shape))
    return Bool(shape, tuple(a.remapped(mapping, shape) for a in value.atoms))


def _broadcast(values, node: Node):
    try:
        shape = tuple(torch.broadcast_shapes(*(v.shape for v in values)))
    except RuntimeError:
        raise Unsupported(node, "operands that do not broadcast") from None
    out = []
    for v in values:
        offset = len(shape) - len(v.shape)
        out.append(_reaxis(v, {k: k + offset for k in range(len(v.shape))}, shape))
    return shape, out


def describe(form: Mapping, names=None) -> str:
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


def describe_index(form: Mapping) -> str:
    return describe(form).removesuffix(" <= 0")


class Interpreter:
    def __init__(self):
        self.memo: dict[Node, object] = {}
        self.tables: list[Node] = []

    def value(self, x, node: Node):
        """The abstract value of an argument of ``node``."""
        if isinstance(x, Node):
            try:
                return self.eval(x)
            except Unsupported as e:
                if e.node.op == "placeholder":  # name the user's line that reads the input
                    raise Unsupported(node, e.what) from None
                raise
        if isinstance(x, bool):
            raise Unsupported(node, f"a Python bool operand ({x})")
        if isinstance(x, int):
            return Int((), {CONST: x} if x else {})
        raise Unsupported(node, f"an operand {x!r}")

    def eval(self, node: Node):
        if node not in self.memo:
            self.memo[node] = self._eval(node)
        return self.memo[node]

    def _eval(self, node: Node):
        name = op_name(node)
        if node.op == "placeholder":
            return self._placeholder(node)
        if node.op not in ("call_function", "call_method"):
            raise Unsupported(node, f"a {node.op} node")
        out_shape = shape_of(node)
        if name == "arange":
            start, end, step = arange_bounds(node)
            if not all(isinstance(b, int) for b in (start, end, step)) or step != 1:
                raise Unsupported(node, "torch.arange with a step or bounds that are not constant ints")
            return Int(out_shape, _prune(combine((1, {("ax", 0): 1}), (1, {CONST: start} if start else {})), out_shape))
        if name in ("to", "long", "int", "contiguous", "clone", "type_as", "bool", "detach"):
            return self._cast(node)
        if name in ("add", "sub", "neg", "mul", "radd", "rsub"):
            return self._arith(node, name, out_shape)
        if name in ("le", "lt", "ge", "gt"):
            return self._compare(node, name, out_shape)
        if name in ("and_", "logical_and", "bitwise_and", "__and__"):
            a, b = (self.value(x, node) for x in node.args[:2])
            if not (isinstance(a, Bool) and isinstance(b, Bool)):
                raise Unsupported(node, "& of non-boolean operands")
            _, (a, b) = _broadcast([a, b], node)
            return Bool(out_shape, a.atoms + b.atoms)
        if name in ("invert", "logical_not", "bitwise_not", "__invert__"):
            a = self.value(node.args[0], node)
            if not isinstance(a, Bool) or len(a.atoms) != 1 or not isinstance(a.atoms[0], Atom):
                raise Unsupported(node, "negation of anything but one comparison")
            (atom,) = a.atoms
            return Bool(out_shape, (Atom(combine((-1, atom.form), (1, {CONST: 1})), node),))
        if name in ("new_ones", "ones") and fake_value(node).dtype == torch.bool:
            return Bool(out_shape, ())
        if name == "where":
            return self._additive(node, out_shape)
        if name == "pad":
            return self._right_padded(node, out_shape)
        if name in SHAPE_VIEWS or name == "getitem":
            return self._view(node, name, out_shape)
        raise Unsupported(node, f"{name or node.target!r}, an op the mask prover does not model")

    def _placeholder(self, node: Node):
        """A graph input: a 2-D bool mask is a key-padding read, an integer tensor a read of
        itself; a float or higher-rank mask built outside the graph is refused."""
        value = fake_value(node)
        if isinstance(value, torch.Tensor) and value.dim() >= 3 and (value.dtype == torch.bool or value.dtype.is_floating_point):
            raise Unsupported(node, (
                f"graph input {placeholder_name(node)}, a {value.dim()}-D mask built outside the graph (as Hugging Face "
                f"generate() builds one over the cache tensors' slots, which under DCP are this rank's shard). Pass a "
                f"2-D padding mask [batch, positions] instead; for generate(), call "
                f"dcp_compile.hf.compile_for_generate(model, group) first"))
        if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 2:
            return _key_mask_input(node, tuple(value.shape))
        if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise Unsupported(node, f"graph input {placeholder_name(node)} (not an integer position tensor: a padding or custom mask?)")
        shape = tuple(value.shape)
        return Int(shape, _prune({("in", node, tuple(range(len(shape)))): 1}, shape))

    def _cast(self, node: Node):
        """A cast that keeps integers integer and booleans boolean; an integer padding mask
        cast to bool is a key-padding read (``!= 0``)."""
        base = self.value(node.args[0], node)
        dtype = fake_value(node).dtype
        if dtype == torch.bool and isinstance(base, Int) and len(base.shape) == 2:
            table = _key_mask_table(node)
            if table is not None and base.form == {("in", table, (0, 1)): 1}:
                return _key_mask_input(table, base.shape)  # an integer padding mask read as != 0
        if (dtype == torch.bool) != isinstance(base, Bool) or dtype.is_floating_point:
            raise Unsupported(node, f"a cast to {dtype}")
        return base

    def _compare(self, node: Node, name: str, out_shape):
        """``a <= b`` and the like of integer forms: one atom ``form <= 0`` (integer
        semantics: ``a < b`` is ``a - b + 1 <= 0``)."""
        a, b = (self.value(x, node) for x in node.args[:2])
        if not (isinstance(a, Int) and isinstance(b, Int)):
            raise Unsupported(node, f"{name} of non-integer operands")
        _, (a, b) = _broadcast([a, b], node)
        diff = {"le": combine((1, a.form), (-1, b.form)), "lt": combine((1, a.form), (-1, b.form), (1, {CONST: 1})),
                "ge": combine((1, b.form), (-1, a.form)), "gt": combine((1, b.form), (-1, a.form), (1, {CONST: 1}))}[name]
        return Bool(out_shape, (Atom(diff, node),))

    def _arith(self, node, name, out_shape):
        if name == "neg":
            a = self.value(node.args[0], node)
            operands = [(-1, a)]
        else:
            a, b = (self.value(x, node) for x in node.args[:2])
            if name == "mul":
                scalar = [v for v in (a, b) if isinstance(v, Int) and set(v.form) <= {CONST}]
                if not scalar or not (isinstance(a, Int) and isinstance(b, Int)):
                    raise Unsupported(node, "a product of two index tensors")
                k = scalar[0].form.get(CONST, 0)
                other = b if scalar[0] is a else a
                operands = [(k, other)]
            else:
                sign = {"add": (1, 1), "radd": (1, 1), "sub": (1, -1), "rsub": (-1, 1)}[name]
                operands = [(sign[0], a), (sign[1], b)]
        if not all(isinstance(v, Int) for _, v in operands):
            raise Unsupported(node, f"{name} of boolean tensors")
        _, aligned = _broadcast([v for _, v in operands], node)
        return Int(out_shape, combine(*((c, v.form) for (c, _), v in zip(operands, aligned))))

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
            raise Unsupported(node, "torch.where other than where(allowed, 0, -inf)")
        base = self.value(cond, node)
        if not isinstance(base, Bool):
            raise Unsupported(node, "torch.where over a non-boolean condition")
        offset = len(out_shape) - len(base.shape)
        return _reaxis(base, {k: k + offset for k in range(len(base.shape))}, out_shape)

    def _right_padded(self, node, out_shape):
        """``F.pad(mask, (0, p))`` of a computed boolean mask (transformers' padding of a
        mask narrower than the keys): False past the old width ``W`` of the last axis,
        the atom ``ax - (W - 1) <= 0``."""
        widths, mode, value = arg(node, 1, "pad"), arg(node, 2, "mode", "constant"), arg(node, 3, "value", None)
        base = self.value(node.args[0], node)
        if (not isinstance(base, Bool) or mode != "constant" or value not in (None, 0, False) or len(widths) != 2
                or widths[0] != 0):
            raise Unsupported(node, "a pad other than a boolean mask right-padded with False along its last axis")
        last = len(out_shape) - 1
        padded = _reaxis(base, {k: k for k in range(len(base.shape))}, out_shape)
        if widths[1] == 0:
            return padded
        edge = Atom(_prune({("ax", last): 1, CONST: 1 - base.shape[-1]}, out_shape), node)
        return Bool(out_shape, padded.atoms + (edge,))

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
                    raise Unsupported(node, f"indexing with {entry!r} (only None, : and ... are modelled)")
            for rest in range(in_axis, len(in_shape)):
                mapping[rest] = out_axis + rest - in_axis
            return _reaxis(base, mapping, out_shape)
        if name == "expand":
            offset = len(out_shape) - len(in_shape)
            for k, n in enumerate(in_shape):
                if n != 1 and out_shape[k + offset] != n:
                    raise Unsupported(node, "an expand that changes a non-unit axis")
            return _reaxis(base, {k: k + offset for k in range(len(in_shape))}, out_shape)
        # unsqueeze / squeeze / view / reshape / flatten: only unit axes may come or go.
        keep_in = [k for k, n in enumerate(in_shape) if n != 1]
        keep_out = [k for k, n in enumerate(out_shape) if n != 1]
        if [in_shape[k] for k in keep_in] != [out_shape[k] for k in keep_out]:
            raise Unsupported(node, f"a {name} from {list(in_shape)} to {list(out_shape)} that merges or splits axes")
        mapping = dict(zip(keep_in, keep_out))
        mapping.update({k: None for k in range(len(in_shape)) if k not in mapping})
        return _reaxis(base, mapping, out_shape)

    def _gather(self, node, base, index: tuple, out_shape):
        """``x[i_0, ..., i_{r-1}]`` of a computed tensor ``x`` by one integer tensor per
        axis: entry ``o`` is ``x[i_0[o], ...]``, so axis ``k``'s term becomes ``i_k``'s
        form.  An input read along axis ``k`` stays a read along one axis only where
        ``i_k`` is exactly one axis of the result."""
        if len(index) != len(base.shape):
            raise Unsupported(node, f"advanced indexing of a {len(base.shape)}-D tensor with {len(index)} index tensors")
        indices = [self.value(e, node) for e in index]
        if not all(isinstance(v, Int) for v in indices):
            raise Unsupported(node, "advanced indexing with non-integer tensors")
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
            raise Unsupported(node, (
                f"advanced indexing that reads graph input {placeholder_name(input_node)} at "
                f"{describe_index(form)} (only a plain axis of the result is modelled)"))

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
                out = combine((1, out), *pieces)
            return _prune(out, out_shape)

        if isinstance(base, Int):
            return Int(out_shape, substitute(base.form))
        atoms = []
        for a in base.atoms:
            if isinstance(a, KeyAtom):
                atoms.append(KeyAtom(a.table, substitute(a.batch), substitute(a.slot), a.node))
            else:
                atoms.append(Atom(substitute(a.form), a.node))
        return Bool(out_shape, tuple(atoms))

    def _key_mask_lookup(self, node, table: Node, index: tuple, out_shape):
        """``pad[batch_idx, slot_idx]``: a key-padding read; proven only if the indices
        turn out to be the batch and the slot axes."""
        rows, slots = (self.value(e, node) for e in index)
        if not (isinstance(rows, Int) and isinstance(slots, Int)):
            raise Unsupported(node, f"indexing {placeholder_name(table)} with non-integer tensors")
        _, (rows, slots) = _broadcast([rows, slots], node)
        offset = len(out_shape) - len(rows.shape)
        rows, slots = (_reaxis(v, {k: k + offset for k in range(len(v.shape))}, out_shape) for v in (rows, slots))
        return Bool(out_shape, (KeyAtom(table, rows.form, slots.form, node),))

    def _table_lookup(self, node, table: Node, index: tuple, out_shape):
        """``table[None, ..., positions, ...]`` of a 2-D table [P, S]: row ``positions``."""
        value = fake_value(table)
        if value.dim() != 2 or not (value.dtype == torch.bool or value.dtype.is_floating_point):
            raise Unsupported(node, f"indexing graph input {placeholder_name(table)} of shape {tuple(value.shape)} "
                                     f"(a causal-mask table is a 2-D [positions, slots] bool or additive tensor)")
        tensors = [i for i, e in enumerate(index) if isinstance(e, Node)]
        real = [e for e in index if e is not None]
        if len(tensors) != 1 or real[0] is not index[tensors[0]] or any(
            not (isinstance(e, slice) and e == slice(None)) for e in real[1:]
        ):
            raise Unsupported(node, f"indexing table {placeholder_name(table)} other than table[..., positions, :]")
        rows = self.value(index[tensors[0]], node)
        if not isinstance(rows, Int):
            raise Unsupported(node, "a table row index that is not an integer tensor")
        leading = sum(1 for e in index[: tensors[0]] if e is None)
        trailing = sum(1 for e in index[tensors[0] + 1 :] if e is None)
        if trailing:
            raise Unsupported(node, "unit axes after the table's row index")
        rows = _reaxis(rows, {k: k + leading for k in range(len(rows.shape))}, out_shape[:-1])
        slot_axis = len(out_shape) - 1
        self.tables.append(table)
        form = _prune(combine((1, {("ax", slot_axis): 1}), (-1, rows.form)), out_shape)
        return Bool(out_shape, (Atom(form, node),))


def _key_mask_input(table: Node, shape) -> Bool:
    """A 2-D mask input ``[B, W]`` as a key-padding atom over its own two axes."""
    return Bool(shape, (KeyAtom(table, _prune({("ax", 0): 1}, shape), _prune({("ax", 1): 1}, shape), table),))


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
