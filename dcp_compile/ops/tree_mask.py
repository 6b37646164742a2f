"""``dcp::tree_positions``: how a tree's ancestor mask enters a compiled graph.

A tree verify (or a tree draft depth) brings new tokens that share positions: siblings
sit at one depth.  The model's own mask (``slots <= positions``) cannot tell a node's
ancestors from its cousins, and the model's forward takes no mask argument.  So the
caller passes its positions through this op, with the ``[B, T, T]`` ancestor mask beside
them (``TreeCall`` does), and ``dcp.backend`` takes the op out of the graph before its
passes run (``strip_tree_positions``): the positions feed the model as before, and the
mask goes to every window attention the passes insert.

Any other route reaches the op's kernel, which raises: without the passes the model
would attend by position and let a node see its siblings.
"""

from __future__ import annotations

import itertools
import types

import torch
from torch import nn
from torch.fx import GraphModule, Node


@torch.library.custom_op("dcp::tree_positions", mutates_args=())
def tree_positions(positions: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    raise RuntimeError(
        "a tree step (new tokens sharing positions, masked by their ancestors) ran outside a graph compiled by "
        "dcp.backend: without its passes the model would attend by position and let each node see its siblings. "
        "Compile the TreeCall with torch.compile(..., backend=dcp.backend(group, ...), fullgraph=True)"
    )


@tree_positions.register_fake
def _tree_positions_fake(positions, ancestors):
    return torch.empty_like(positions)


TREE_POSITIONS = torch.ops.dcp.tree_positions.default


def _tree_call(self, tokens, positions, ancestors, *rest):
    return self.model(tokens, TREE_POSITIONS(positions, ancestors), *rest)


_instances = itertools.count()


class TreeCall(nn.Module):
    """``forward(tokens, positions, ancestors, *rest)``: ``model(tokens, positions, *rest)``
    under the ancestor mask ``ancestors [B, T, T]`` (bool; ``[b, t, s]``: new token ``t``
    sees new token ``s``).  Compile it with ``dcp.backend``; nothing else runs it.

    Each instance's forward has a code object of its own: Dynamo caches compiled graphs
    (and counts them against its recompile limit) per code object, and one decoder
    wraps the target's verify and every draft depth, in processes that build many."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        code = _tree_call.__code__.replace(co_name=f"tree_call_{next(_instances)}")
        self.forward = types.MethodType(types.FunctionType(code, _tree_call.__globals__), self)


def strip_tree_positions(gm: GraphModule) -> Node | None:
    """Replace the marker by its positions and return the ancestor mask's node (``None``
    where the graph holds no marker).  One graph holds one tree."""
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is TREE_POSITIONS]
    if not found:
        return None
    masks = {n.args[1] for n in found}
    if len(masks) > 1:
        raise ValueError(f"a graph takes one tree mask, but its positions pass through {len(masks)} of them")
    for node in found:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    gm.recompile()
    return masks.pop()
