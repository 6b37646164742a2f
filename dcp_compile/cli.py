"""dcp-compile command line.

    dcp-compile demo                       # spawns 2 CPU ranks itself
    torchrun --nproc-per-node 2 -m dcp_compile.cli demo --device cuda
    dcp-compile train --device cuda --out runs/tiny-code --measure-acceptance
    dcp-compile eval --model tiny-code     # accept length on held-out files
    dcp-compile gate --dcp 2               # the correctness gate on held-out prompts
    dcp-compile serve --model HF_DIR --draft EAGLE3_DIR   # a Hugging Face model and its published draft
    dcp-compile export --model tiny-code --out DIR        # the shipped pair in the published formats
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from dcp_compile import gate
from dcp_compile.runtime.generate import DEFAULT_CHUNK_SIZE

DEMO_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'import os\n\n\ndef list_python_files(root):\n    """',
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n",
)

MODEL_HELP = ("a shipped name (tiny-code), a `dcp-compile train` directory, or a Hugging Face causal-LM directory "
              "(read from disk, never the hub)")
DRAFT_HELP = ("an EAGLE3 or EAGLE-1 draft checkpoint directory in the published layouts, for a Hugging Face --model; "
              "without one, that model decodes one token per step")


def _text(codec, tokens) -> str:
    decoder = codec.decoder()
    return decoder.push([int(t) for t in tokens]) + decoder.finish()


def _device(name: str) -> torch.device:
    return torch.device(name if name == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")


def _compile_progress(decoder, label: str, enabled: bool):
    """A bar over the decoder's graphs while the first call compiles them."""
    import threading

    from tqdm.auto import tqdm

    backends = [b for b in (decoder.target_backend, decoder.verify_backend, decoder.draft_backend) if b is not None]
    # prefill, verify, and the draft's prefill, extend and step graphs
    total = 5 if decoder.draft is not None else 2
    bar = tqdm(total=total, desc=label, unit="graph", disable=not enabled, leave=True, dynamic_ncols=True)
    done = threading.Event()

    def poll():
        while not done.wait(0.25):
            seen = min(total, sum(len(b.compiled) for b in backends))
            if seen != bar.n:
                bar.update(seen - bar.n)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()

    def close():
        done.set()
        thread.join()
        bar.update(min(total, sum(len(b.compiled) for b in backends)) - bar.n)
        bar.close()

    return close


def _dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """``--dtype`` where the command has it; else bf16 on CUDA and fp32 on CPU."""
    name = getattr(args, "dtype", None) or ("bfloat16" if device.type == "cuda" else "float32")
    return getattr(torch, name)


def _draft_tokens(args) -> int:
    """Draft tokens per step: ``--k``, or 0 for a model served without a draft."""
    return args.k if args.spec.speculative else 0


def _decoder(args, group, *, max_batch: int, max_seq_len: int):
    """The models of ``--model`` / ``--draft`` on this rank, in a ``SpecDecoder``."""
    import dcp_compile as dcp
    from dcp_compile import loading

    target, draft = loading.load(args.spec, max_batch=max_batch, max_seq_len=max_seq_len, device=group.device,
                                 dtype=_dtype(args, group.device))
    return dcp.SpecDecoder(target, draft, group, k=_draft_tokens(args), max_batch=max_batch, max_seq_len=max_seq_len,
                           temperature=args.temperature, seed=args.seed, lowering=args.lowering,
                           chunk_size=min(args.chunk_size, max_seq_len))


def _describe(spec) -> str:
    if spec.kind == "pair":
        return f"model {spec.name!r} (target + EAGLE3 draft)"
    from dcp_compile.models.eagle_checkpoint import inspect

    if spec.draft is None:
        return f"Hugging Face model {str(spec.path)!r}, no draft (one token per step)"
    return f"Hugging Face model {str(spec.path)!r} + {inspect(spec.draft).kind.upper()} draft {str(spec.draft)!r}"


def _run_arm(name, group, args, prompts, talk, stream=None, header="") -> dict:
    """Load, compile (warm-up call) and time one arm; returns its outputs and numbers."""
    from dcp_compile.runtime.engine import generate_all

    device = group.device
    k = _draft_tokens(args)
    max_seq_len = max(len(p) for p in prompts) + args.max_new_tokens + k + 1
    decoder = _decoder(args, group, max_batch=len(prompts), max_seq_len=max_seq_len)
    stops = args.codec.eos_ids
    close = _compile_progress(decoder, f"  {name}: compiling", talk)
    start = time.perf_counter()
    try:
        generate_all(decoder, prompts, k + 2, stop_ids=stops)
    finally:
        close()
    compile_s = time.perf_counter() - start
    if talk and header:
        print(header, end="", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    outputs = generate_all(decoder, prompts, args.max_new_tokens, stop_ids=stops, on_tokens=stream)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    n_tokens = sum(len(o.tokens) for o in outputs)
    steps = sum(len(o.accepted) for o in outputs)
    return dict(
        outputs=outputs, compile_s=compile_s, seconds=seconds, tokens=n_tokens,
        tokens_per_s=n_tokens / seconds, accept_len=sum(a + 1 for o in outputs for a in o.accepted) / max(1, steps),
    )


def _demo_rank(rank: int, size: int, args: argparse.Namespace) -> dict | None:
    import dcp_compile as dcp

    from dcp_compile import loading

    device = _device(args.device)
    group = dcp.init_group(device)
    talk = group.rank == 0 and not args.json
    args.codec = codec = loading.codec(args.spec)
    texts = args.prompt or DEMO_PROMPTS
    prompts = [codec.encode(p) for p in texts]
    k = _draft_tokens(args)
    if talk:
        sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
        chain = f"chain k={k}" if k else "no speculation"
        print(f"dcp-compile demo: {_describe(args.spec)}, {chain}, {sampling}, "
              f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, lowering {args.lowering}\n"
              f"DCP arm: group of {group.size} ({group.backend or 'single process'}, {device.type}); "
              f"off arm: plain torch.compile on one rank", flush=True)
    streamed = codec.decoder(prompts[0])

    def stream(request: int, new_tokens: list[int]) -> None:
        if talk and request == 0:
            print(streamed.push(new_tokens), end="", flush=True)

    header = f"--- prompt 0, streamed from the DCP arm ---\n{texts[0]}"
    dcp_arm = _run_arm(f"DCP arm, size {group.size}", group, args, prompts, talk, stream, header)
    if group.rank != 0:
        return None
    if talk:
        print(streamed.finish() + "\n--- end of stream ---")
    off_arm = _run_arm("off arm, size 1", dcp.DCPGroup(1, 0, device, None), args, prompts, talk)
    dcp_out, off_out = dcp_arm["outputs"], off_arm["outputs"]
    tokens_identical = all(a.tokens == b.tokens for a, b in zip(dcp_out, off_out))
    accepts_identical = all(a.accepted == b.accepted for a, b in zip(dcp_out, off_out))
    verdict = gate.evaluate([o.tokens for o in dcp_out], [o.accepted for o in dcp_out], [o.tokens for o in off_out],
                            [o.accepted for o in off_out], k=k, dtype=str(_dtype(args, device)).split(".")[-1])
    if talk:
        for i, (prompt, out) in enumerate(zip(texts[1:], dcp_out[1:]), start=1):
            print(f"\n--- prompt {i} ---\n{prompt}{_text(codec, out.tokens)}")
        print()
        for label, arm in ((f"DCP arm (size {group.size})", dcp_arm), ("off arm (size 1)", off_arm)):
            accept = f"mean accept length {arm['accept_len']:.2f} at k={k}" if k else "one token per step"
            print(f"{label:>18}: {arm['tokens']} tokens in {arm['seconds']:.2f}s = {arm['tokens_per_s']:.1f} tokens/s, "
                  f"{accept} (compile {arm['compile_s']:.1f}s)")
        print(f"{'parity':>18}: tokens identical = {tokens_identical}, accept counts identical = {accepts_identical}")
        print(f"{'gate':>18}: {verdict.describe()}")
        if device.type == "cpu":
            print(f"{'':>18}  (CPU ranks share this machine's cores: tokens/s here is not a DCP speed figure)")
    return dict(
        dcp_size=group.size, k=k, temperature=args.temperature, model=args.model, draft=args.draft,
        tokens_identical=tokens_identical, accept_counts_identical=accepts_identical,
        accept_len=dict(dcp=dcp_arm["accept_len"], off=off_arm["accept_len"]),
        tokens_per_s=dict(dcp=dcp_arm["tokens_per_s"], off=off_arm["tokens_per_s"]),
        compile_s=dict(dcp=dcp_arm["compile_s"], off=off_arm["compile_s"]),
        new_tokens=[len(o.tokens) for o in dcp_out],
        finished_by=[o.finished_by for o in dcp_out],
        gate=verdict.as_dict(),
    )


def demo(args: argparse.Namespace) -> int:
    from dcp_compile.runtime.launch import spawn_ranks

    if "RANK" in os.environ:  # under torchrun: this process is one rank
        summary = _demo_rank(int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", 1)), args)
    else:
        if args.device == "cuda" and torch.cuda.device_count() < args.dcp:
            raise SystemExit(f"--dcp {args.dcp} on cuda needs {args.dcp} GPUs, found {torch.cuda.device_count()}")
        summary = spawn_ranks(_demo_rank, args.dcp, args, timeout=1800)[0]
    if summary is not None:
        if args.json:
            print(json.dumps(summary))
        return 0 if summary["gate"]["passed"] else 1
    return 0


def _gate_arm(group, args, prompts, talk: bool, label: str) -> tuple[list, list]:
    from tqdm.auto import tqdm

    from dcp_compile.runtime.engine import generate_all

    max_seq_len = max(len(p) for p in prompts) + args.max_new_tokens + _draft_tokens(args) + 1
    batch = min(args.batch, len(prompts))
    decoder = _decoder(args, group, max_batch=batch, max_seq_len=max_seq_len)
    tokens, accepted = [], []
    for start in tqdm(range(0, len(prompts), batch), desc=label, unit="batch", disable=not talk, leave=False):
        for out in generate_all(decoder, prompts[start : start + batch], args.max_new_tokens):
            tokens.append(out.tokens)
            accepted.append(out.accepted)
    return tokens, accepted


def _gate_rank(rank: int, size: int, args: argparse.Namespace) -> dict | None:
    import dcp_compile as dcp
    from dcp_compile import loading, training

    device = _device(args.device)
    group = dcp.init_group(device)
    talk = group.rank == 0 and not args.json
    codec = None if args.spec.kind == "pair" else loading.codec(args.spec)
    prompts = training.held_out_prompts(args.prompts, args.prompt_bytes, seed=args.seed, codec=codec)
    dcp_tokens, dcp_accepted = _gate_arm(group, args, prompts, talk, f"DCP arm, size {group.size}")
    if group.rank != 0:
        return None
    off_tokens, off_accepted = _gate_arm(dcp.DCPGroup(1, 0, device, None), args, prompts, talk, "off arm")
    k = _draft_tokens(args)
    verdict = gate.evaluate(dcp_tokens, dcp_accepted, off_tokens, off_accepted, k=k,
                            dtype=str(_dtype(args, device)).split(".")[-1])
    if talk:
        print(f"DCP size {group.size} against the off arm, {_describe(args.spec)}, k={k}, temperature "
              f"{args.temperature}, {len(prompts)} held-out prompts x {args.max_new_tokens} new tokens")
        print(f"accept-count histogram, DCP: {verdict.histogram_dcp}; off: {verdict.histogram_off}")
        print(verdict.describe())
    return dict(verdict.as_dict(), dcp_size=group.size, k=k, temperature=args.temperature, model=args.model,
                draft=args.draft, prompts=len(prompts), max_new_tokens=args.max_new_tokens)


def gate_command(args: argparse.Namespace) -> int:
    from dcp_compile.runtime.launch import spawn_ranks

    if "RANK" in os.environ:
        summary = _gate_rank(int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", 1)), args)
    else:
        if args.device == "cuda" and torch.cuda.device_count() < args.dcp:
            raise SystemExit(f"--dcp {args.dcp} on cuda needs {args.dcp} GPUs, found {torch.cuda.device_count()}")
        summary = spawn_ranks(_gate_rank, args.dcp, args, timeout=3600)[0]
    if summary is None:
        return 0
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["passed"] else 1


def train_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dcp_compile import training

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


def export_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from dcp_compile.export import export_pair

    try:
        written = export_pair(args.model, args.out, progress=True)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        parser.error(f"export --model {args.model!r} --out {args.out!r}: {err}")
    print(json.dumps(written, default=str))
    return 0


def eval_command(args: argparse.Namespace) -> int:
    from dcp_compile import training

    result = training.measure_acceptance(
        args.spec, device=args.device, k=args.k, n_prompts=args.prompts, new_tokens=args.max_new_tokens,
        lowering=args.lowering,
    )
    print(json.dumps(result))
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
    from dcp_compile.models.llama import llama3_8b_shape
    from dcp_compile.models import DraftConfig, eagle3_aux_layers

    sizes = _int_list(parser, "--dcp", args.dcp)
    batches = _int_list(parser, "--batches", args.batches)
    contexts = _int_list(parser, "--contexts", args.contexts)
    if args.k < 0:
        parser.error(f"--k must be >= 0, got {args.k}")
    if args.gpu_gib is not None:
        if args.gpu_gib <= 0:
            parser.error(f"--gpu-gib must be > 0, got {args.gpu_gib}")
        budget = int(args.gpu_gib * memory.GiB)
    elif torch.cuda.is_available():
        budget = memory.device_budget("cuda:0")
    else:
        parser.error("no CUDA device here to read the memory from: pass --gpu-gib (e.g. 139.8 for an H200)")
    from dcp_compile.models.mla import deepseek_v2_lite_shape, deepseek_v3_attention_shape, draft_config

    mla_shapes = {"deepseek-v2-lite": deepseek_v2_lite_shape, "deepseek-v3": deepseek_v3_attention_shape}
    if args.model == "llama3-8b":
        cfg = llama3_8b_shape()
        draft = DraftConfig(cfg, "eagle3") if args.k else None
    elif args.model in mla_shapes:
        cfg = mla_shapes[args.model](aux_layers=eagle3_aux_layers(mla_shapes[args.model]().n_layers))
        draft = draft_config(cfg) if args.k else None
        print(f"{args.model}: the reference MLA shape (latent cache {cfg.kv_lora_rank} + rope key "
              f"{cfg.qk_rope_head_dim} per token and layer); a dense MLP stands in for the MoE, so the weights "
              f"figure is the stand-in's")
    else:
        cfg, draft = _check_model(parser, args.model, f"; or one of the shapes llama3-8b, {', '.join(mla_shapes)}")
        draft = draft if args.k else None
    planner = memory.MemoryPlanner(cfg, budget, getattr(torch, args.dtype), draft,
                                   verify_tokens=args.k + 1 if args.k else 0)
    longest, widest = memory.capacity_tables(planner, sizes, batches, contexts)
    base = planner.plan(sizes[0], 1, 1)
    print(f"{args.model}: weights {base.weight_bytes / memory.GiB:.1f} GiB per GPU, budget "
          f"{budget / memory.GiB:.1f} GiB (of which {memory.BASE_RESERVE_BYTES / memory.GiB:.0f} GiB plus the step's "
          f"logits are kept for activations), {args.dtype}, " + (f"EAGLE3 draft, k={args.k}" if draft else "no draft"))
    header = " | ".join(f"DCP={n}" for n in sizes)
    print(f"\nlongest context per sequence (tokens)\n| batch | {header} |\n|---|" + "---|" * len(sizes))
    for batch, row in longest.items():
        print(f"| {batch} | " + " | ".join(f"{row[n]:,}" if row[n] else "does not fit" for n in sizes) + " |")
    print(f"\nmost sequences at a context\n| context | {header} |\n|---|" + "---|" * len(sizes))
    for context, row in widest.items():
        print(f"| {context:,} | " + " | ".join(f"{row[n]:,}" for n in sizes) + " |")
    return 0


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
    from dcp_compile import loading

    try:
        spec = loading.resolve(args.model, args.draft)
    except (FileNotFoundError, ValueError) as err:
        flags = f"--model {args.model!r}" + (f" --draft {args.draft!r}" if args.draft else "")
        parser.error(f"{flags}: {err}")
    return spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-compile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="speculative decoding with a DCP-sharded target, checked against the size-1 arm")
    d.add_argument("--dcp", type=int, default=2, help="DCP group size when spawning ranks (default 2)")
    d.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    d.add_argument("--k", type=int, default=4, help="draft tokens per verify step (default 4)")
    d.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; > 0 samples (rejection sampling)")
    d.add_argument("--seed", type=int, default=0, help="sampling seed, shared by every rank")
    d.add_argument("--max-new-tokens", type=int, default=160)
    d.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                   help=f"prompt tokens per prefill step (default {DEFAULT_CHUNK_SIZE}; capped at the cache)")
    d.add_argument("--prompt", action="append", help="a prompt (repeat for a batch); default: three code prompts")
    d.add_argument("--model", default="tiny-code", help=MODEL_HELP)
    d.add_argument("--draft", help=DRAFT_HELP)
    d.add_argument(
        "--lowering", choices=("inductor", "aot_eager"),
        help="after the DCP passes: inductor (Triton on CUDA, C++ on CPU) or aot_eager (no codegen); default inductor "
             "on cuda, aot_eager on cpu, where Inductor's C++ compile of seven graphs on two shared cores takes minutes",
    )
    d.add_argument("--json", action="store_true", help="print one JSON summary line and nothing else")
    g = sub.add_parser("gate", help="the correctness gate: DCP arm against the off arm on held-out prompts")
    g.add_argument("--dcp", type=int, default=2, help="DCP group size when spawning ranks (default 2)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="float32: exact rule; bfloat16 / float16: paired statistical rule (default: bf16 on cuda, fp32 on cpu)")
    g.add_argument("--prompts", type=int, default=32, help="held-out prompts (default 32; use 256 or more in bf16)")
    g.add_argument("--prompt-bytes", type=int, default=128)
    g.add_argument("--batch", type=int, default=16, help="prompts per decoder batch")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--k", type=int, default=4)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    g.add_argument("--model", default="tiny-code", help=MODEL_HELP)
    g.add_argument("--draft", help=DRAFT_HELP)
    g.add_argument("--lowering", choices=("inductor", "aot_eager"))
    g.add_argument("--json", action="store_true", help="print one JSON line and nothing else")
    t = sub.add_parser("train", help="train the byte-level target and its EAGLE3 draft on the Python standard library")
    t.add_argument("--out", required=True, help="checkpoint directory to write")
    t.add_argument("--preset", default="tiny-code", help="model and schedule: tiny-code (shipped) or smoke")
    t.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--target-steps", type=int)
    t.add_argument("--draft-steps", type=int)
    t.add_argument("--batch", type=int)
    t.add_argument("--measure-acceptance", action="store_true", help="then measure the accept length on held-out files")
    e = sub.add_parser("eval", help="mean accept length of a checkpoint's draft on held-out standard-library files")
    e.add_argument("--model", default="tiny-code", help=MODEL_HELP)
    e.add_argument("--draft", help=DRAFT_HELP)
    e.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    e.add_argument("--k", type=int, default=4)
    e.add_argument("--prompts", type=int, default=32)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--lowering", choices=("inductor", "aot_eager"), default="aot_eager")
    x = sub.add_parser("export", help="write a pair in the published formats: the target as a transformers "
                                      "LlamaForCausalLM directory (with its tokenizer), the draft as an EAGLE3 checkpoint")
    x.add_argument("--model", default="tiny-code", help="a shipped name or a `dcp-compile train` directory")
    x.add_argument("--out", required=True, help="directory to write (target/ and draft/ go inside); must be empty")
    s = sub.add_parser("serve", help="an OpenAI-compatible server (completions, chat completions, models; streaming)")
    from dcp_compile import serve as serving

    serving.add_arguments(s)
    p = sub.add_parser("plan", help="what batch x context fits on one GPU at each DCP size, before anything is allocated")
    p.add_argument("--model", default="llama3-8b", help="llama3-8b (the shape), deepseek-v2-lite or deepseek-v3 (the MLA "
                   "reference shapes), a shipped name or a checkpoint directory")
    p.add_argument("--gpu-gib", type=float, help="memory per GPU in GiB; default: the total of CUDA device 0")
    p.add_argument("--dcp", default="1,2,4,8", help="DCP sizes (comma-separated)")
    p.add_argument("--batches", default="1,8,16,64")
    p.add_argument("--contexts", default="8192,32768,131072,524288")
    p.add_argument("--k", type=int, default=3, help="EAGLE3 chain length (verify staging and draft); 0: no draft")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device here; run on a GPU machine, "
                     f"or pass --device cpu")
    if args.command in ("demo", "gate", "eval", "serve"):
        args.spec = _resolve_model(parser, args)
    if args.command == "export":
        return export_command(parser, args)
    if args.command == "plan":
        return plan_command(parser, args)
    if args.command == "serve":
        serving.check_arguments(parser, args)
        return serving.serve(args)
    if args.command == "train":
        return train_command(args)
    if args.command == "eval":
        if not args.spec.speculative:
            parser.error(f"eval measures a draft's accept length: --model {args.model!r} needs --draft DIR")
        return eval_command(args)
    if args.command == "gate":
        if min(args.dcp, args.k, args.prompts, args.prompt_bytes, args.batch, args.max_new_tokens, args.chunk_size) < 1:
            parser.error("--dcp, --k, --prompts, --prompt-bytes, --batch, --max-new-tokens and --chunk-size must be >= 1")
        if args.temperature < 0:
            parser.error(f"--temperature must be >= 0, got {args.temperature}")
        args.lowering = args.lowering or ("inductor" if args.device == "cuda" else "aot_eager")
        return gate_command(args)
    if args.command == "demo":
        if args.dcp < 1 or args.max_new_tokens < 1 or args.k < 1:
            parser.error("--dcp, --k and --max-new-tokens must be >= 1")
        if args.temperature < 0:
            parser.error(f"--temperature must be >= 0, got {args.temperature}")
        if args.chunk_size < 1:
            parser.error(f"--chunk-size must be >= 1, got {args.chunk_size}")
        if args.prompt and any(not p for p in args.prompt):
            parser.error("--prompt must not be empty")
        args.lowering = args.lowering or ("inductor" if args.device == "cuda" else "aot_eager")
        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
