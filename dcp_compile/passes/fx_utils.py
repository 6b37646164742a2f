"""Small helpers shared by the passes: naming ops, locating nodes in user code."""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable

import torch
from torch.fx import GraphModule, Node

_SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)


SHAPE_VIEWS = frozenset({"view", "reshape", "unsqueeze", "squeeze", "expand", "flatten"})
"""Ops that rearrange a tensor's axes without changing its values."""
INTEGER_CASTS = frozenset({"to", "long", "int", "contiguous"})
"""Ops an index tensor passes through unchanged (for integer values)."""
INDEX_VIEWS = SHAPE_VIEWS | INTEGER_CASTS | {"getitem"}
"""What may stand between an index tensor (positions, ``arange``) and its source."""
LAYOUT_ONLY = frozenset({"contiguous", "to", "float", "half", "bfloat16", "type_as", "clone", "detach", "type"})
"""Ops that keep a tensor's values and axes (copies and casts)."""


class GraphPatternError(ValueError):
    """A graph the passes cannot handle; the message names the node and the user's line."""


def source_line(node: Node) -> str:
    """The innermost user frame that produced ``node``, as ``file:line: code``."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return f"<no source recorded for FX node {node.name}>"
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    frames = []
    for i, line in enumerate(lines):
        if line.startswith("File "):
            where = line.replace("File ", "").replace('"', "").replace(", line ", ":").split(",")[0]
            frames.append(f"{where}: {lines[i + 1] if i + 1 < len(lines) else ''}")
    # The innermost frame outside torch itself: F.pad's wrapper is not the user's line.
    # torch is told by its package directory, not by a "torch" anywhere in the path: an
    # environment under /opt/torch/.venv holds transformers' and the user's files too.
    user = [f for f in frames if not f.startswith(_TORCH_PACKAGE)]
    return (user or frames or lines)[-1]


_TORCH_PACKAGE = os.path.dirname(torch.__file__) + os.sep


def where(node: Node) -> str:
    """``node`` plus its source line, for error messages."""
    return f"FX node '{node.name}' at {source_line(node)}"


def op_name(node: Node) -> str | None:
    """A method-style name for call_method and call_function nodes (``"transpose"`` for both
    ``x.transpose(...)`` and ``torch.transpose(x, ...)``); ``None`` for other nodes."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return "getitem"
    if node.target is operator.setitem:
        return "setitem"
    if node.target in _SDPA_TARGETS:
        return "scaled_dot_product_attention"
    # Dynamo inlines user functions, so what remains as call_function targets are torch
    # functions, builtins and op overloads; their names are unambiguous here.
    return getattr(node.target, "__name__", None)


def is_sdpa(node: Node) -> bool:
    return node.op == "call_function" and node.target in _SDPA_TARGETS


def is_flex_attention(node: Node) -> bool:
    return node.op == "call_function" and "flex_attention" in str(node.target)


def fake_value(node: Node):
    """The fake tensor (or value) Dynamo recorded for ``node``."""
    return node.meta.get("example_value", node.meta.get("val"))


def shape_of(node: Node) -> tuple[int, ...]:
    value = fake_value(node)
    if not isinstance(value, torch.Tensor):
        raise GraphPatternError(f"expected a tensor at {where(node)}, found {type(value).__name__}")
    return tuple(int(s) for s in value.shape)


def arg(node: Node, index: int, name: str, default=None):
    """Positional-or-keyword argument of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def placeholder_name(node: Node) -> str:
    """A readable source for a graph input, e.g. ``L['self'].layers[0].attn.k_cache``."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    return source.name if source is not None and hasattr(source, "name") else node.name


def erase_dead_pure_nodes(gm: GraphModule, candidates: Iterable[Node]) -> None:
    """Erase nodes among ``candidates`` (and their pure producers) that lost all users.

    FX's own dead-code elimination treats in-place methods such as ``index_copy_`` as
    pure and would delete KV writes, so the passes only ever erase what they orphaned.
    """
    stack = list(candidates)
    while stack:
        node = stack.pop()
        if node.graph is not gm.graph or node.users or node.op in ("placeholder", "output"):
            continue
        name = op_name(node) or ""
        if name == "setitem" or name.endswith("_") or node.op not in ("call_function", "call_method"):
            continue
        inputs = list(node.all_input_nodes)
        gm.graph.erase_node(node)
        stack.extend(inputs)


def arange_bounds(node: Node) -> tuple | None:
    """``(start, end, step)`` of a ``torch.arange`` node, as its arguments give them
    (ints, or nodes for bounds computed in the graph); ``None`` for any other node."""
    if not isinstance(node, Node) or op_name(node) != "arange":
        return None
    args = list(node.args)
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args + [1])[:3]
    return node.kwargs.get("start", start), node.kwargs.get("end", end), node.kwargs.get("step", step)


def expand_ellipsis(index: tuple, ndim: int) -> tuple:
    """A ``getitem`` / ``setitem`` index with its ``...`` spelled out as full slices over
    an ``ndim``-axis tensor (``None`` entries add axes and take none)."""
    if Ellipsis not in index:
        return index
    at = index.index(Ellipsis)
    explicit = sum(1 for e in index if e is not None and e is not Ellipsis)
    return index[:at] + (slice(None),) * (ndim - explicit) + index[at + 1 :]
