"""Run a function on N local ranks (spawned processes, gloo or NCCL over loopback).

Used by ``dcp-compile demo`` when it is not under torchrun, and by the multi-rank
tests.  Every rank gets the torchrun environment variables, so the function calls
``dcp.init_group()`` exactly as it would under torchrun.  A rank's exception is
re-raised in the parent with its traceback (a ``UsageError`` with its message alone); a
rank that hangs is killed after ``timeout`` seconds.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class UsageError(ValueError):
    """Options a rank found it cannot run with (known only once it has its prompts or its
    model): the command reports the message, not a traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, size: int, port: int, results, threads: int, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    try:
        # Bytes, not tensors: a tensor sent through a multiprocessing queue lives in this
        # process's shared memory, which is gone once the rank exits.
        buffer = io.BytesIO()
        torch.save(fn(rank, size, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except UsageError as error:
        results.put((rank, None, str(error)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], size: int, *args, timeout: float = 600.0, threads: int | None = None) -> list:
    """Run ``fn(rank, size, *args)`` on ``size`` processes; return the results by rank.

    ``fn`` must be importable by name (a module-level function), and its arguments and
    result picklable.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    threads = threads or max(1, (os.cpu_count() or 1) // size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, size, port, results, threads, args), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    try:
        while len(outputs) < size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(size)) - set(outputs))} gave no result within {timeout:.0f}s") from None
            if ok is None:
                raise UsageError(value)
            if not ok:
                raise RuntimeError(f"rank {rank} of {size} failed:\n{value}")
            outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [outputs[r] for r in range(size)]
