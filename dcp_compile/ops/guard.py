"""``dcp::require_dcp_backend``: the mark that keeps a sharded model off every other route.

After ``dcp.prepare`` a target's KV caches hold one rank's shard.  Any code that runs
its forward without the DCP passes (eagerly, under another ``torch.compile`` backend,
under Inductor alone, in a Hugging Face loop that compiles only some calls) would
attend over that shard alone and answer wrongly, differently on every rank.

So every input of a sharded forward, and every key/value a sharded Hugging Face cache
stores, goes through this identity op.  ``dcp.backend`` removes it from the graph
(``strip_backend_guards``) before its passes run; every other route reaches the op's
kernel, which raises before the step writes anything, since every write depends on
the guarded inputs.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule


@torch.library.custom_op("dcp::require_dcp_backend", mutates_args=())
def require_dcp_backend(x: torch.Tensor, owner: str) -> torch.Tensor:
    raise RuntimeError(
        f"{owner} holds KV caches that dcp.prepare sharded (this rank keeps 1/N of every sequence), but this call "
        f"did not go through a graph compiled by dcp.backend: run eagerly, or compiled by another backend (plain "
        f"torch.compile, Inductor, aot_eager) or only partly compiled (a Hugging Face loop whose prefill or "
        f"generate() is not compiled), its attention would see only this rank's slots. Call the model through "
        f"torch.compile(model, backend=dcp.backend(group, role='target'), fullgraph=True), for every call (for "
        f"Hugging Face generate(): dcp_compile.hf.compile_for_generate(model, group) first). Nothing was written to "
        f"the caches"
    )


@require_dcp_backend.register_fake
def _require_dcp_backend_fake(x, owner):
    return torch.empty_like(x)


GUARD = torch.ops.dcp.require_dcp_backend.default


def guard(x: torch.Tensor, owner: str) -> torch.Tensor:
    """``x``, marked: only ``dcp.backend`` lets it through."""
    return GUARD(x, owner)


def strip_backend_guards(gm: GraphModule) -> int:
    """Replace every guard node by its input; returns how many there were."""
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is GUARD]
    for node in found:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    if found:
        gm.recompile()
    return len(found)
