"""prepare's check that the D ranks of a DCP group inside tensor parallelism hold the same
KV: they shard one copy of the same KV heads by token, so their caches must be computed
from the same weights, whoever sharded the model (``dcp.tensor_parallel``, DeepSeek's
Column/RowParallelLinear, torch's ``parallelize_module``).

The weights a KV write depends on are found in prepare's discovery graph: walking back
from every KV write to the parameters it reads, stopping at collectives.  Under TP the
walk reaches the KV projections, the norms and the embedding, never the query or output
heads of earlier layers, whose outputs reach the residual stream only through an
all-reduce.  Three spellings of that all-reduce stop the walk: a functional collective;
``dist.all_reduce(y)`` in place, which Dynamo records as ``y.copy_(wait(all_reduce(y)))``
(later reads of ``y`` are followed to the value copied in); and a DTensor's
``redistribute`` of a partial sum.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.fx import GraphModule, Node

from dcp_compile.group import DCPGroup, gather_from_ranks
from dcp_compile.passes.check import is_collective
from dcp_compile.passes.find import Plan


def _copied_into(gm: GraphModule):
    """``source(node, reader)``: what ``node`` holds where ``reader`` reads it, following
    the in-place ``node.copy_(src)`` calls before ``reader``."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    copies: dict[Node, list[Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_method" and n.target == "copy_" and isinstance(n.args[0], Node):
            copies.setdefault(n.args[0], []).append(n)

    def source(node: Node, reader: Node) -> Node:
        while node in copies:
            before = [c for c in copies[node] if order[c] < order[reader]]
            if not before:
                break
            node = before[-1].args[1]
        return node

    return source


def _sums_a_partial(node: Node) -> bool:
    """A DTensor ``redistribute`` of a partial sum: the all-reduce of a row-parallel layer."""
    if node.op != "call_method" or node.target != "redistribute" or not isinstance(node.args[0], Node):
        return False
    value = node.args[0].meta.get("example_value")
    return isinstance(value, DTensor) and any(p.is_partial() for p in value.placements)


def kv_weights(gm: GraphModule, plan: Plan, inputs, weights: dict[int, tuple]) -> dict[str, torch.Tensor]:
    """``{name: parameter}`` of the weights the cached keys and values are computed from
    within this rank (``weights``: id of a graph input -> its name and real parameter)."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    source = _copied_into(gm)
    found, seen, stack = {}, set(), [w.value for w in plan.writes]
    while stack:
        node = stack.pop()
        if not isinstance(node, Node) or node in seen:
            continue
        seen.add(node)
        if is_collective(node) or _sums_a_partial(node):
            continue
        if node in placeholders and id(inputs[placeholders[node]]) in weights:
            name, tensor = weights[id(inputs[placeholders[node]])]
            found[name] = tensor
        stack.extend(source(i, node) for i in node.all_input_nodes)
    return dict(sorted(found.items()))


def _fingerprint(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Two float64 sums of this rank's values (plain, and weighted by a fixed sequence),
    enough to tell different slices of a weight apart without moving the weight."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    flat = local.detach().reshape(-1).double()
    weight = torch.sin(torch.arange(flat.numel(), device=flat.device, dtype=torch.float64))
    return torch.stack([flat.sum(), (flat * weight).sum()]).to(device)


def check_peers_hold_the_same_kv(group: DCPGroup, gm: GraphModule, plan: Plan, inputs, weights) -> None:
    """Refuse, on every rank of the DCP group together, ranks whose KV comes from
    different weights."""
    tensors = kv_weights(gm, plan, inputs, weights)
    if not tensors:
        return
    prints = torch.stack([_fingerprint(t, group.device) for t in tensors.values()])
    everyone = gather_from_ranks(group, prints, dcp_only=True)
    differ = [r for r, p in enumerate(everyone) if not torch.equal(p, everyone[0])]
    if differ:
        names = [n for i, n in enumerate(tensors) if any(not torch.equal(p[i], everyone[0][i]) for p in everyone)]
        raise ValueError(
            f"the ranks of this DCP group compute their KV caches from different weights: DCP ranks {differ} differ "
            f"from DCP rank 0 in {names[:4]}{' ...' if len(names) > 4 else ''}. Inside tensor parallelism (TP size "
            f"{group.tp_size}, DCP size {group.size}) a DCP group's ranks must hold the same KV heads, which needs "
            f"D | T/H_kv for GQA (T > H_kv) and D | T for MLA; choose such a DCP size, or shard the KV projections "
            f"so that the D ranks of each block hold the same heads"
        )
