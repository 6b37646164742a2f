"""The DCP process group: who the ranks are, and how collectives reach them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, eq=False)
class DCPGroup:
    """A fixed group of ranks that share every sequence's target KV cache."""

    size: int
    rank: int
    device: torch.device
    """Device this rank computes on (``cuda:LOCAL_RANK`` under NCCL, else CPU)."""
    process_group: dist.ProcessGroup | None = field(repr=False)
    """None for a group of size 1, which never communicates."""

    @property
    def group_name(self) -> str:
        """Name the functional collectives use to find the process group."""
        if self.process_group is None:
            raise ValueError("a DCP group of size 1 has no process group")
        return self.process_group.group_name

    @property
    def backend(self) -> str | None:
        return None if self.process_group is None else dist.get_backend(self.process_group)


def init_group(
    device: str | torch.device | None = None, *, timeout: timedelta = timedelta(minutes=10)
) -> DCPGroup:
    """Join the DCP group described by the torchrun environment.

    - Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) it
      initialises the default process group: NCCL when the device is CUDA, gloo on CPU.
    - With no such environment, or ``WORLD_SIZE=1``, it returns a group of size 1, the
      "off arm" that compiles exactly as plain ``torch.compile``.
    - If the default process group already exists, it is reused.

    ``device`` defaults to ``cuda:LOCAL_RANK`` when CUDA is available, else CPU.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)

    if dist.is_initialized():
        pg = dist.group.WORLD
        return DCPGroup(dist.get_world_size(pg), dist.get_rank(pg), device, pg if dist.get_world_size(pg) > 1 else None)

    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if not present or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return DCPGroup(1, 0, device, None)
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
    return DCPGroup(dist.get_world_size(), dist.get_rank(), device, dist.group.WORLD)


def gather_from_ranks(group: DCPGroup, values: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``values`` (same shape and dtype on all ranks), in rank order.

    An eager collective, for checks between steps; never call it inside a compiled or
    captured step."""
    values = values.to(group.device).contiguous()
    if group.size == 1:
        return [values]
    everyone = [torch.empty_like(values) for _ in range(group.size)]
    dist.all_gather(everyone, values, group=group.process_group)
    return everyone


def ranks_that_differ(group: DCPGroup, values: torch.Tensor) -> list[int]:
    """Ranks whose ``values`` differ bitwise from rank 0's (NaN equals NaN of the same
    bits); the same list on every rank, so all ranks can raise together instead of one
    of them hanging in the next collective."""
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[values.element_size()]
    everyone = gather_from_ranks(group, values.contiguous().view(bits))
    return [r for r, v in enumerate(everyone) if not torch.equal(v, everyone[0])]
