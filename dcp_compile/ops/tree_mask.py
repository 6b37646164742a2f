"""``dcp::tree_positions``: how a tree's ancestor mask enters a compiled graph.

A tree verify (or a tree draft depth) brings new tokens that share positions: siblings
sit at one depth.  The model's own mask (``slots <= positions``) cannot tell a node's
ancestors from its cousins, and the model's forward takes no mask argument.  So the
caller passes its positions through this op, with the ``[B, T, T]`` ancestor mask beside
them (``TreeCall`` does), and ``dcp.backend`` takes the op out of the graph before its
passes run (``strip_tree_positions``): the positions feed the model as before, and the
mask goes to every window attention the passes insert.

A tree draft's depths (``TreeCall(draft, staged=True)``) bring one depth's nodes at a
time and see their ancestors in the draft's tree slots (``prepare(..., tree_slots=)``):
their mask is ``[B, T, S + T]`` over the ``S`` nodes earlier depths left there and the
``T`` new ones, and ``cached [B]`` says where the draft's cache ends (the nodes sit past
it, at their depths' positions, so the positions cannot say it).

Any other route reaches the op's kernel, which raises: without the passes the model
would attend by position and let a node see its siblings.
"""

from __future__ import annotations

import itertools
import types
from typing import NamedTuple

import torch
from torch import nn
from torch.fx import GraphModule, Node


@torch.library.custom_op("dcp::tree_positions", mutates_args=())
def tree_positions(positions: torch.Tensor, ancestors: torch.Tensor, cached: torch.Tensor | None = None) -> torch.Tensor:
    raise RuntimeError(
        "a tree step (new tokens sharing positions, masked by their ancestors) ran outside a graph compiled by "
        "dcp.backend: without its passes the model would attend by position and let each node see its siblings. "
        "Compile the TreeCall with torch.compile(..., backend=dcp.backend(group, ...), fullgraph=True)"
    )


@tree_positions.register_fake
def _tree_positions_fake(positions, ancestors, cached=None):
    return torch.empty_like(positions)


TREE_POSITIONS = torch.ops.dcp.tree_positions.default


def _tree_call(self, tokens, positions, ancestors, *rest):
    return self.model(tokens, TREE_POSITIONS(positions, ancestors), *rest)


def _staged_tree_call(self, tokens, positions, ancestors, cached, *rest):
    return self.model(tokens, TREE_POSITIONS(positions, ancestors, cached), *rest)


_instances = itertools.count()


class TreeCall(nn.Module):
    """``forward(tokens, positions, ancestors, *rest)``: ``model(tokens, positions, *rest)``
    under the ancestor mask ``ancestors [B, T, T]`` (bool; ``[b, t, s]``: new token ``t``
    sees new token ``s``).  Compile it with ``dcp.backend``; nothing else runs it.

    ``staged=True`` (a tree draft's depth): ``forward(tokens, positions, ancestors,
    cached, *rest)``, ``ancestors [B, T, S + T]`` over the ``S`` nodes in the draft's
    tree slots and the ``T`` new ones (which the call stores at tree slots ``S..S+T-1``),
    ``cached [B]`` the draft cache's length per row.

    Each instance's forward has a code object of its own: Dynamo caches compiled graphs
    (and counts them against its recompile limit) per code object, and one decoder
    wraps the target's verify and every draft depth, in processes that build many."""

    def __init__(self, model: nn.Module, staged: bool = False):
        super().__init__()
        self.model = model
        call = _staged_tree_call if staged else _tree_call
        code = call.__code__.replace(co_name=f"tree_call_{next(_instances)}")
        self.forward = types.MethodType(types.FunctionType(code, call.__globals__), self)


class TreeMarks(NamedTuple):
    """What a graph's marker carried: the ancestor mask's node, and the draft cache's
    length where the call was staged (``None`` for a verify)."""

    ancestors: Node
    cached: Node | None


def strip_tree_positions(gm: GraphModule) -> TreeMarks | None:
    """Replace the marker by its positions and return what it carried (``None`` where
    the graph holds no marker).  One graph holds one tree."""
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is TREE_POSITIONS]
    if not found:
        return None
    marks = {TreeMarks(n.args[1], n.args[2] if len(n.args) > 2 else n.kwargs.get("cached")) for n in found}
    if len(marks) > 1:
        raise ValueError(f"a graph takes one tree mask, but its positions pass through {len(marks)} of them")
    for node in found:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    gm.recompile()
    return marks.pop()
