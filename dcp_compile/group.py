"""The process groups of one model replica: the tensor-parallel (TP) group of T ranks, and
inside it the DCP groups of D ranks that share every sequence's target KV cache.

DCP groups are contiguous blocks of D ranks of the TP group (as in vLLM and SGLang): with
T = 4 and D = 2, ranks {0, 1} and {2, 3}.  Without TP (T = 1) the DCP group is the whole
world and every rank holds every weight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, eq=False)
class DCPGroup:
    """A fixed group of ranks that share every sequence's target KV cache, and the TP
    group it lies in."""

    size: int
    """D: ranks of the DCP group."""
    rank: int
    """This rank's place in the DCP group, in ``[0, D)``: the KV layout's rank."""
    device: torch.device
    """Device this rank computes on (``cuda:LOCAL_RANK`` under NCCL, else CPU)."""
    process_group: dist.ProcessGroup | None = field(repr=False)
    """None for a group of size 1, which never communicates."""
    tp_size: int = 1
    """T: ranks of the tensor-parallel group (1: every rank holds every weight)."""
    tp_rank: int = 0
    """This rank's place in the TP group: which query heads and weight shards it holds."""
    tp_process_group: dist.ProcessGroup | None = field(default=None, repr=False)
    """None for ``tp_size == 1``."""

    @property
    def group_name(self) -> str:
        """Name the functional collectives use to find the process group."""
        if self.process_group is None:
            raise ValueError("a DCP group of size 1 has no process group")
        return self.process_group.group_name

    @property
    def tp_group_name(self) -> str:
        """Name of the TP group for the functional collectives (the TP all-reduce)."""
        if self.tp_process_group is None:
            raise ValueError("a TP group of size 1 has no process group")
        return self.tp_process_group.group_name

    @property
    def heads_split(self) -> bool:
        """Whether the DCP peers hold different query heads (TP: each rank holds its own
        1/T of them), so that a target attention gathers the peers' queries."""
        return self.tp_size > 1

    @property
    def replica_size(self) -> int:
        """Ranks that run one model replica in lockstep: the TP group, or the DCP group
        without TP.  Checks that all ranks agree, and the serving leader, span these."""
        return self.tp_size if self.tp_size > 1 else self.size

    @property
    def replica_rank(self) -> int:
        return self.tp_rank if self.tp_size > 1 else self.rank

    @property
    def replica_process_group(self) -> dist.ProcessGroup | None:
        return self.tp_process_group if self.tp_size > 1 else self.process_group

    @property
    def backend(self) -> str | None:
        pg = self.replica_process_group
        return None if pg is None else dist.get_backend(pg)


def _resolve_device(device) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def _init_world(device: torch.device, timeout: timedelta) -> bool:
    """Initialise the default process group from the torchrun environment (or reuse it);
    False where there is no world of more than one rank."""
    if dist.is_initialized():
        return True
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if not present or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return False
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise ValueError(
            f"incomplete torchrun environment: {present} are set but {missing} are not; launch with "
            f"`torchrun --nproc-per-node N ...` or unset them for a single-process group"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return True


def check_sizes(tp: int, dcp: int) -> None:
    """Refuse a TP x DCP layout that no model can take: D must divide T."""
    for name, value in (("tp", tp), ("dcp", dcp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if tp > 1 and tp % dcp:
        raise ValueError(
            f"DCP size {dcp} does not divide TP size {tp}: DCP groups are contiguous blocks of D ranks inside the "
            f"TP group, so D must divide T (for example --tp {tp} --dcp {max(d for d in range(1, dcp + 1) if tp % d == 0)})"
        )


def tp_dcp_groups(replicas: list[list[int]], dcp: int | list[int], device: torch.device) -> DCPGroup:
    """This rank's groups, for TP groups over ``replicas`` (lists of global ranks, one per
    model replica, together the whole world) with DCP groups of ``dcp`` contiguous ranks
    inside each (one size for all, or one per replica).  Collective: every rank of the
    world calls it with the same arguments, since ``dist.new_group`` is; ``init_group``
    makes one replica of the whole world."""
    world, me = dist.get_world_size(), dist.get_rank()
    sizes = dcp if isinstance(dcp, list) else [dcp] * len(replicas)

    def new_group(ranks: list[int]):
        return dist.group.WORLD if len(ranks) == world else dist.new_group(ranks)

    mine = None
    for tp_ranks, dcp in zip(replicas, sizes, strict=True):
        check_sizes(len(tp_ranks), dcp)
        tp_pg = new_group(tp_ranks) if len(tp_ranks) > 1 else None
        blocks = [tp_ranks[i:i + dcp] for i in range(0, len(tp_ranks), dcp)]
        dcp_pgs = [new_group(block) if dcp > 1 else None for block in blocks]
        if me in tp_ranks:
            tp_rank = tp_ranks.index(me)
            mine = DCPGroup(dcp, tp_rank % dcp, device, dcp_pgs[tp_rank // dcp], len(tp_ranks), tp_rank, tp_pg)
    if mine is None:
        raise ValueError(f"rank {me} is in none of the TP groups {replicas}")
    return mine


def init_group(
    device: str | torch.device | None = None, *, tp: int | None = None, dcp: int | None = None,
    timeout: timedelta = timedelta(minutes=10),
) -> DCPGroup:
    """Join the groups described by the torchrun environment.

    - ``init_group()``: the world is one DCP group and every rank holds every weight
      (``tp_size == 1``).
    - ``init_group(tp=T, dcp=D)``: the world of T ranks is one TP group (``dcp`` defaults
      to 1: plain TP), and DCP groups are contiguous blocks of D ranks inside it.  The
      world must have T ranks, and D must divide T.
    - Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) it
      initialises the default process group: NCCL when the device is CUDA, gloo on CPU.
      With no such environment, or ``WORLD_SIZE=1``, there is no process group: a group
      of size 1, the "off arm" that compiles exactly as plain ``torch.compile``.
    - If the default process group already exists, it is reused.

    ``device`` defaults to ``cuda:LOCAL_RANK`` when CUDA is available, else CPU.
    """
    device = _resolve_device(device)
    if tp is None and dcp is not None:
        raise ValueError(f"init_group(dcp={dcp}) without tp: the DCP group is the whole world unless tp=T is given; "
                         f"pass tp=T (the world size) and dcp=D, or neither")
    if tp is not None:
        dcp = 1 if dcp is None else dcp
        check_sizes(tp, dcp)
    multi = _init_world(device, timeout)
    world = dist.get_world_size() if multi else 1
    if tp is None:
        if world == 1:
            return DCPGroup(1, 0, device, None)
        pg = dist.group.WORLD
        return DCPGroup(world, dist.get_rank(pg), device, pg)
    if world != tp:
        raise ValueError(
            f"init_group(tp={tp}, dcp={dcp}) needs a world of {tp} ranks (one TP group), but the world has {world}; "
            f"launch with `torchrun --nproc-per-node {tp} ...`"
        )
    if world == 1:
        return DCPGroup(1, 0, device, None)
    return tp_dcp_groups([list(range(world))], dcp, device)


def gather_from_ranks(group: DCPGroup, values: torch.Tensor, *, dcp_only: bool = False) -> list[torch.Tensor]:
    """Every rank's ``values`` (same shape and dtype on all ranks), in rank order, over the
    replica (the TP group, or the DCP group without TP), or over the DCP group alone.

    An eager collective, for checks between steps; never call it inside a compiled or
    captured step."""
    values = values.to(group.device).contiguous()
    size, pg = (group.size, group.process_group) if dcp_only else (group.replica_size, group.replica_process_group)
    if size == 1:
        return [values]
    everyone = [torch.empty_like(values) for _ in range(size)]
    dist.all_gather(everyone, values, group=pg)
    return everyone


def ranks_that_differ(group: DCPGroup, values: torch.Tensor, *, dcp_only: bool = False) -> list[int]:
    """Ranks whose ``values`` differ bitwise from rank 0's (NaN equals NaN of the same
    bits); the same list on every rank, so all ranks can raise together instead of one
    of them hanging in the next collective."""
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[values.element_size()]
    everyone = gather_from_ranks(group, values.contiguous().view(bits), dcp_only=dcp_only)
    return [r for r, v in enumerate(everyone) if not torch.equal(v, everyone[0])]
