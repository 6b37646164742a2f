"""A step's decisions in leader mode, and how rank 0 sends them to the other ranks.

Each step starts with one fixed-size broadcast of ``2 + B x 9`` int64s from rank 0 (whether
to stop, how many prompt tokens follow, then per row: admitted, request id, prompt length,
``max_new_tokens``, temperature bits, has a seed, the seed, ``eos_id``, aborted), then the
admitted prompts' tokens, host to host in a gloo group of its own.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dcp_compile.runtime.request import SamplingParams, _Request

_FIELDS = 9


@dataclass
class Plan:
    """One step's decisions: rank 0's, broadcast to the others in leader mode."""

    stop: bool = False
    aborts: list[int] = field(default_factory=list)
    """Rows whose request is aborted."""
    admits: list[_Request] = field(default_factory=list)
    """Requests admitted, each with its ``row`` set."""


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _encode(plan: Plan, rows: int) -> tuple[torch.Tensor, list[int]]:
    header = torch.zeros(2 + rows * _FIELDS, dtype=torch.long)
    prompt_tokens = []
    header[0] = int(plan.stop)
    table = header[2:].view(rows, _FIELDS)
    for request in plan.admits:
        p = request.params
        table[request.row, :8] = torch.tensor([
            1, request.id, len(request.prompt), p.max_new_tokens, _float_bits(request.temperature),
            int(p.seed is not None), p.seed or 0, -1 if p.eos_id is None else p.eos_id])
        prompt_tokens += request.prompt
    for row in plan.aborts:
        table[row, 8] = 1
    header[1] = len(prompt_tokens)
    return header, prompt_tokens


def _decode(header: list[int], tokens: list[int], rows: int) -> Plan:
    plan = Plan(stop=bool(header[0]))
    for row in range(rows):
        admit, rid, length, max_new, temperature, has_seed, seed, eos, abort = header[2 + row * _FIELDS:][:_FIELDS]
        if abort:
            plan.aborts.append(row)
        if admit:
            params = SamplingParams(max_new_tokens=max_new, temperature=_bits_float(temperature),
                                    seed=seed if has_seed else None, eos_id=None if eos < 0 else eos)
            plan.admits.append(_Request(rid, tokens[:length], params, params.temperature, row=row))
            tokens = tokens[length:]
    return plan


def broadcast_plan(plan: Plan | None, rows: int, group, wait: Callable) -> Plan:
    """Rank 0 passes its ``plan`` and gets it back; the others pass ``None`` and get rank 0's.
    ``wait(work)`` waits for each broadcast (with the engine's timeout)."""
    header, prompt_tokens = _encode(plan if plan is not None else Plan(), rows)
    wait(dist.broadcast(header, src=0, group=group, async_op=True))
    if plan is not None:
        if prompt_tokens:
            wait(dist.broadcast(torch.tensor(prompt_tokens), src=0, group=group, async_op=True))
        return plan
    header = header.tolist()
    tokens = torch.empty(header[1], dtype=torch.long)
    if header[1]:
        wait(dist.broadcast(tokens, src=0, group=group, async_op=True))
    return _decode(header, tokens.tolist(), rows)
