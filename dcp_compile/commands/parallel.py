"""``--tp`` and ``--dcp`` for the commands that decode: how many ranks to start, how each
joins its groups, and the target's shard (``dcp.tensor_parallel``) once it is loaded.

Without ``--tp`` (T = 1) the ranks are one DCP group of ``--dcp`` ranks, each holding every
weight.  With ``--tp T`` the world is T ranks, one TP group, and ``--dcp D`` (which must
divide T) makes the DCP groups contiguous blocks of D ranks inside it.
"""

from __future__ import annotations

import argparse
import os

import torch

TP_HELP = ("tensor-parallel size: the world of T ranks shards the target's heads and MLP, and --dcp D (which must "
           "divide T) shards the KV copies TP leaves by token (default 1: every rank holds every weight)")


def add_tp_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help=TP_HELP)


def world_size(args: argparse.Namespace) -> int:
    """Ranks a command starts (or that torchrun must have started)."""
    return args.tp if args.tp > 1 else args.dcp


def check_tp(parser: argparse.ArgumentParser, args: argparse.Namespace, spec=None) -> None:
    """``--tp`` refused as usage errors (exit 2), in the command's own process, before any
    rank starts: T < 1, a DCP size that does not divide T, a torchrun world of another
    size, or a model the package cannot shard."""
    from dcp_compile.group import check_sizes

    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.tp == 1:
        return
    try:
        check_sizes(args.tp, args.dcp)
    except ValueError as error:
        parser.error(f"--tp {args.tp} --dcp {args.dcp}: {error}")
    world = os.environ.get("WORLD_SIZE")
    if "RANK" in os.environ and world is not None and int(world) != args.tp:
        parser.error(f"--tp {args.tp} needs a world of {args.tp} ranks (one TP group), but torchrun started {world}; "
                     f"launch with `torchrun --nproc-per-node {args.tp} ...`")
    if spec is not None and spec.kind != "pair":
        from transformers import AutoConfig

        from dcp_compile.hf.native import check

        try:
            check(AutoConfig.from_pretrained(str(spec.path), local_files_only=True))
        except (OSError, ValueError) as error:
            parser.error(f"--tp {args.tp}: {str(spec.path)!r}: {error}")
    if args.device == "cuda" and "RANK" not in os.environ and torch.cuda.device_count() < args.tp:
        parser.error(f"--tp {args.tp} on cuda needs {args.tp} GPUs, found {torch.cuda.device_count()}")


def join(args: argparse.Namespace, device, **options):
    """This rank's groups for ``--tp`` / ``--dcp``."""
    import dcp_compile as dcp

    if args.tp > 1:
        return dcp.init_group(device, tp=args.tp, dcp=args.dcp, **options)
    return dcp.init_group(device, **options)


def native(args: argparse.Namespace) -> bool:
    """Whether a Hugging Face or GGUF model loads as the package's own ``Llama``: under
    ``--tp``, where ``dcp.tensor_parallel`` shards it (every arm alike, so the arms compare
    one computation)."""
    return getattr(args, "tp", 1) > 1


def shard(target, group):
    """The target, tensor-parallel over the group's TP ranks (unchanged without TP)."""
    import dcp_compile as dcp

    return dcp.tensor_parallel(target, group) if group.tp_size > 1 else target


def describe(group, without_tp: str) -> str:
    """``TP T x DCP D``, or ``without_tp`` (a template of the DCP size) for a group without TP."""
    return f"TP {group.tp_size} x DCP {group.size}" if group.tp_size > 1 else without_tp.format(group.size)
