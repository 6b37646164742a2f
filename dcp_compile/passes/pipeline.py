"""The pass runner: orders the passes for a role, logs and times each, and can dump
the graph before and after every pass."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch.fx import GraphModule, Node

from dcp_compile.layout import KVLayout
from dcp_compile.passes.check import check_draft, check_target
from dcp_compile.passes.find import Plan
from dcp_compile.passes.shard_attention import TreeSlots, shard_attention
from dcp_compile.passes.shard_kv_writes import shard_kv_writes

log = logging.getLogger("dcp_compile.passes")

Pass = Callable[[GraphModule, Plan], GraphModule]


@dataclass(frozen=True)
class PassTiming:
    name: str
    seconds: float


def target_passes(
    layout: KVLayout, group_name: str | None, staging_first_slot: int | None = None, comm: str = "ag",
    ancestors: Node | None = None, heads_split: bool = False,
) -> list[Pass]:
    """``staging_first_slot``: set for verify graphs, whose KV writes wait for a commit.
    ``comm``: how partials meet (``shard_attention.COMMS``).  ``ancestors``: the graph's
    tree mask node (``ops.tree_mask``), for every window.  A layout of size 1 is the
    single-GPU cascade: attention becomes prefix + window + merge with no collective,
    and the writes stay where they are (every position is this rank's) unless they wait
    in staging (a tree verify: its siblings share positions).  ``heads_split``: the DCP
    peers hold different query heads (TP), so each site gathers their queries."""
    writes = [] if layout.size == 1 and staging_first_slot is None else [
        functools.partial(shard_kv_writes, layout=layout, staging_first_slot=staging_first_slot)
    ]
    return writes + [
        functools.partial(shard_attention, layout=layout, group_name=group_name, comm=comm, ancestors=ancestors,
                          heads_split=heads_split),
        functools.partial(check_target, comm=comm, size=layout.size, heads_split=heads_split),
    ]


def draft_passes(layout: KVLayout | None = None, ancestors: Node | None = None,
                 slots: TreeSlots | None = None) -> list[Pass]:
    """``layout`` (the draft's whole-cache layout, size 1): lower each attention to the
    cascade with no collective, so the draft reads each sequence's own length of its
    cache, not the cache's capacity; the writes stay as they are.  ``None``: no rewrite.
    ``ancestors``: a tree depth's mask node, for every window.  ``slots``: a tree depth
    that keeps its nodes in the draft's tree slots: its writes go there, and its windows
    read the earlier depths' nodes from there."""
    if layout is None:
        return [check_draft]
    if layout.size != 1:
        raise ValueError(f"a draft's cache is whole on every rank: expected a layout of size 1, got {layout.size}")
    writes = [] if slots is None else [
        functools.partial(shard_kv_writes, layout=layout, staging_first_slot=slots.first_slot + slots.staged)
    ]
    return writes + [
        functools.partial(shard_attention, layout=layout, group_name=None, ancestors=ancestors, slots=slots),
        functools.partial(check_target, size=1),
        functools.partial(check_draft, staged=slots is not None),
    ]


def _name(p: Pass) -> str:
    return getattr(p, "func", p).__name__


def run_passes(
    gm: GraphModule, plan: Plan, passes: list[Pass], *, dump_dir: Path | None = None, tag: str = "graph"
) -> tuple[GraphModule, list[PassTiming]]:
    timings = []
    for i, p in enumerate(passes):
        if dump_dir is not None:
            (dump_dir / f"{tag}_{i:02d}_before_{_name(p)}.py").write_text(gm.code)
        start = time.perf_counter()
        gm = p(gm, plan)
        timings.append(PassTiming(_name(p), time.perf_counter() - start))
        log.info("pass %s took %.1f ms", _name(p), 1e3 * timings[-1].seconds)
    if dump_dir is not None:
        (dump_dir / f"{tag}_{len(passes):02d}_final.py").write_text(gm.code)
    gm.graph.lint()
    return gm, timings
