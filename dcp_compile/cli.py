"""dcp-compile command line.

    dcp-compile demo                       # spawns 2 CPU ranks itself
    torchrun --nproc-per-node 2 -m dcp_compile.cli demo --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

import torch

DEMO_PROMPTS = ("def fib(n):", "import torch\nimport torch.nn as nn\n\nclass Block(nn.Module):", "# Decode context parallelism shards the KV cache by token.\n# Each rank keeps every")


@contextmanager
def _phase(label: str, enabled: bool):
    """One line per phase: what is running, then how long it took."""
    if enabled:
        print(f"  {label} ...", end="", flush=True)
    start = time.perf_counter()
    yield
    if enabled:
        print(f" {time.perf_counter() - start:.1f}s", flush=True)


def _text(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def _demo_rank(rank: int, size: int, args: argparse.Namespace) -> dict | None:
    import dcp_compile as dcp
    from dcp_compile.models import Llama, LlamaConfig, init_weights
    from dcp_compile.runtime.generate import greedy_decode

    device = torch.device(args.device if args.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    group = dcp.init_group(device)
    talk = group.rank == 0 and not args.json
    prompts = [list(p.encode()) for p in (args.prompt or DEMO_PROMPTS)]
    longest = max(len(p) for p in prompts)
    cfg = LlamaConfig(
        vocab_size=256, dim=128, n_layers=4, n_heads=8, n_kv_heads=2, intermediate_size=352,
        max_seq_len=max(128, 1 << (longest + args.max_new_tokens).bit_length()), max_batch=len(prompts),
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def model():
        return init_weights(Llama(cfg), seed=0).to(device=device, dtype=dtype).eval()

    if talk:
        print(f"dcp-compile demo: DCP group of {group.size} ({group.backend or 'single process'}, {device.type}), "
              f"reference Llama {cfg.n_layers} layers, max_seq_len {cfg.max_seq_len}, {len(prompts)} prompts")
    target = model()
    dcp.prepare(target, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
    compiled = torch.compile(target, backend=dcp.backend(group, "target", lowering=args.lowering), fullgraph=True, dynamic=False)
    with _phase(f"DCP arm: compile (prefill + decode graphs) and generate {args.max_new_tokens} tokens", talk):
        start = time.perf_counter()
        dcp_result = greedy_decode(compiled, prompts, args.max_new_tokens, device=device)
        dcp_seconds = time.perf_counter() - start
    if group.rank != 0:
        return None
    off_model = model()
    off = torch.compile(off_model, backend=args.lowering, fullgraph=True, dynamic=False)
    with _phase("off arm (plain torch.compile, one rank): compile and generate", talk):
        off_result = greedy_decode(off, prompts, args.max_new_tokens, device=device)
    identical = torch.equal(dcp_result.tokens, off_result.tokens)
    max_diff = max(float((a - b).abs().max()) for a, b in zip(dcp_result.logits, off_result.logits))
    summary = dict(
        dcp_size=group.size, tokens_identical=identical, max_abs_logit_diff=max_diff,
        new_tokens=int(dcp_result.tokens.numel()), dcp_seconds_with_compile=dcp_seconds,
    )
    if talk:
        for prompt, row in zip(prompts, dcp_result.tokens):
            print(f"\n  prompt {_text(prompt)!r}\n  -> {_text(row)!r}  (token ids {row.tolist()[:12]}...)")
        print(f"\n  parity vs size-1 arm: tokens identical = {identical}, max |logit difference| = {max_diff:.3g}")
        print("  (weights are random: the text is noise until a trained model ships)")
    return summary


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
        return 0 if summary["tokens_identical"] else 1
    return 0


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


def eval_command(args: argparse.Namespace) -> int:
    from dcp_compile import training

    result = training.measure_acceptance(
        args.model, device=args.device, k=args.k, n_prompts=args.prompts, new_tokens=args.max_new_tokens,
        lowering=args.lowering,
    )
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-compile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="decode with a DCP-sharded target and check parity with the size-1 arm")
    d.add_argument("--dcp", type=int, default=2, help="DCP group size when spawning ranks (default 2)")
    d.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    d.add_argument("--max-new-tokens", type=int, default=24)
    d.add_argument("--prompt", action="append", help="a prompt (repeat for a batch); default: three code prompts")
    d.add_argument("--lowering", choices=("inductor", "aot_eager"), default="inductor", help="aot_eager skips codegen")
    d.add_argument("--json", action="store_true", help="print one JSON summary line and nothing else")
    t = sub.add_parser("train", help="train the byte-level target and its EAGLE3 draft on the Python standard library")
    t.add_argument("--out", required=True, help="checkpoint directory to write")
    t.add_argument("--preset", default="tiny-code", help="model and schedule: tiny-code (shipped) or smoke")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--target-steps", type=int)
    t.add_argument("--draft-steps", type=int)
    t.add_argument("--batch", type=int)
    t.add_argument("--measure-acceptance", action="store_true", help="then measure the accept length on held-out files")
    e = sub.add_parser("eval", help="mean accept length of a checkpoint's draft on held-out standard-library files")
    e.add_argument("--model", default="tiny-code", help="shipped name or checkpoint directory")
    e.add_argument("--device", default="cpu")
    e.add_argument("--k", type=int, default=4)
    e.add_argument("--prompts", type=int, default=32)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--lowering", choices=("inductor", "aot_eager"), default="aot_eager")
    args = parser.parse_args(argv)
    if args.command == "train":
        return train_command(args)
    if args.command == "eval":
        return eval_command(args)
    if args.command == "demo":
        if args.dcp < 1 or args.max_new_tokens < 1:
            parser.error("--dcp and --max-new-tokens must be >= 1")
        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
