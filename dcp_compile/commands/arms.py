"""The ``demo`` and ``gate`` commands: the DCP arm (the target sharded over the group) against
the off arm (the same models on one rank), each decoding the same prompts.

A command runs on ranks it spawns itself, or on the ranks ``torchrun`` started (``RANK``
is set); rank 0 runs the off arm after the DCP arm and compares the two (``gate``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from dcp_compile.commands import gate, parallel

DEMO_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'import os\n\n\ndef list_python_files(root):\n    """',
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n",
)
CHAT_PROMPTS = (
    "Write a Python function that reverses a string.",
    "How do I read a JSON file in Python? Show a short example.",
    "Explain what a Python list comprehension is, with one example.",
)
"""The demo's prompts for a model with a chat template: each is one user message."""


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
    total = decoder.graph_count
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


def _shape(args) -> dict:
    """The draft's shape, for ``SpecDecoder`` and the summaries: ``--k``, ``--topk`` and
    ``--draft-tokens`` (``topk=1, draft_tokens=k`` is the chain), or no draft tokens for a
    model served without a draft."""
    if not args.spec.speculative:
        return {"k": 0, "topk": 1, "draft_tokens": 0}
    return {"k": args.k, "topk": args.topk, "draft_tokens": args.draft_tokens}


def _describe_shape(shape: dict) -> str:
    if not shape["k"]:
        return "no speculation"
    if (shape["topk"], shape["draft_tokens"]) == (1, shape["k"]):
        return f"chain k={shape['k']}"
    return f"tree k={shape['k']} topk={shape['topk']} draft_tokens={shape['draft_tokens']}"


def _decoder(args, group, *, max_batch: int, max_seq_len: int):
    """The models of ``--model`` / ``--draft`` on this rank, in a ``SpecDecoder``."""
    import dcp_compile as dcp
    from dcp_compile.commands import loading

    pool = loading.pool_options(args.page_size, args.kv_tokens, max_batch, max_seq_len)
    target, draft = loading.load(args.spec, max_batch=max_batch, max_seq_len=max_seq_len, device=group.device,
                                 dtype=_dtype(args, group.device), native=parallel.native(args), paged=bool(pool))
    parallel.shard(target, group)
    return dcp.SpecDecoder(target, draft, group, **_shape(args), max_batch=max_batch, max_seq_len=max_seq_len,
                           temperature=args.temperature, seed=args.seed, lowering=args.lowering,
                           chunk_size=min(args.chunk_size, max_seq_len), **pool)


def _describe(spec) -> str:
    if spec.kind == "pair":
        return f"model {spec.name!r} (target + EAGLE3 draft)"
    from dcp_compile.models.eagle_checkpoint import inspect

    model = (f"Hugging Face model {str(spec.path)!r}" if spec.kind == "hf"
             else f"GGUF model {spec.source.name!r} (read from {str(spec.path)!r})")
    if spec.draft is None:
        return f"{model}, no draft (one token per step)"
    return f"{model} + {inspect(spec.draft).kind.upper()} draft {str(spec.draft)!r}"


def compile_breakdown(decoder, compile_s: float) -> dict:
    """Where a decoder's first call (``compile_s`` seconds) went: its ``dcp.backend``s'
    ``analysis``, ``passes`` and ``lowering`` and their ``graphs``, and the ``rest``:
    Dynamo's tracing, the graphs compiled outside ``dcp.backend`` (the commit) and the
    call's own run."""
    backends = [b for b in (decoder.target_backend, decoder.verify_backend, decoder.draft_backend) if b is not None]
    parts = [b.compile_seconds() for b in backends]
    totals = {key: sum(p[key] for p in parts) for key in ("analysis", "passes", "lowering", "graphs")}
    totals["rest"] = compile_s - totals["analysis"] - totals["passes"] - totals["lowering"]
    return totals


def _run_arm(name, group, args, prompts, talk, stream=None, header="") -> dict:
    """Load, compile (warm-up call) and time one arm; returns its outputs and numbers."""
    from dcp_compile.runtime.engine import generate_all

    device = group.device
    k = _shape(args)["k"]
    # positions reach the draft depth k only: a tree's extra nodes sit in staging slots
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
    breakdown = compile_breakdown(decoder, compile_s)
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
        outputs=outputs, compile_s=compile_s, compile_breakdown=breakdown, seconds=seconds, tokens=n_tokens,
        tokens_per_s=n_tokens / seconds, accept_len=sum(a + 1 for o in outputs for a in o.accepted) / max(1, steps),
    )


def _print_arms(arms, shape: dict, device: torch.device) -> None:
    for label, arm in arms:
        accept = (f"mean accept length {arm['accept_len']:.2f}, {_describe_shape(shape)}" if shape["k"]
                  else "one token per step")
        print(f"{label:>18}: {arm['tokens']} tokens in {arm['seconds']:.2f}s = {arm['tokens_per_s']:.1f} tokens/s, "
              f"{accept} (compile {arm['compile_s']:.1f}s)")
    if device.type == "cpu":
        print(f"{'':>18}  (CPU ranks share this machine's cores: tokens/s here is not a DCP speed figure)")


def _demo_rank(rank: int, size: int, args: argparse.Namespace) -> dict | None:
    import dcp_compile as dcp
    from dcp_compile.commands import loading

    device = _device(args.device)
    group = parallel.join(args, device)
    talk = group.replica_rank == 0 and not args.json
    args.codec = codec = loading.codec(args.spec)
    chat = getattr(codec, "has_chat_template", False)
    texts = args.prompt or (CHAT_PROMPTS if chat else DEMO_PROMPTS)
    prompts = [codec.chat_ids([{"role": "user", "content": p}]) if chat else codec.encode(p) for p in texts]
    shape = _shape(args)
    k = shape["k"]
    if talk:
        sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
        print(f"dcp-compile demo: {_describe(args.spec)}, {_describe_shape(shape)}, {sampling}, "
              f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, lowering {args.lowering}\n"
              f"DCP arm: {parallel.describe(group, 'group of {}')} ({group.backend or 'single process'}, {device.type}); "
              f"off arm: plain torch.compile on one rank", flush=True)
    streamed = codec.decoder(prompts[0])

    def stream(request: int, new_tokens: list[int]) -> None:
        if talk and request == 0:
            print(streamed.push(new_tokens), end="", flush=True)

    shown = [f"user: {t}\nassistant: " if chat else t for t in texts]
    header = f"--- prompt 0, streamed from the DCP arm ---\n{shown[0]}"
    dcp_arm = _run_arm(f"DCP arm, {parallel.describe(group, 'size {}')}", group, args, prompts, talk, stream, header)
    if group.replica_rank != 0:
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
        for i, (prompt, out) in enumerate(zip(shown[1:], dcp_out[1:]), start=1):
            print(f"\n--- prompt {i} ---\n{prompt}{_text(codec, out.tokens)}")
        print()
        arms = ((f"DCP arm ({parallel.describe(group, 'size {}')})", dcp_arm), ("off arm (size 1)", off_arm))
        _print_arms(arms, shape, device)
        print(f"{'parity':>18}: tokens identical = {tokens_identical}, accept counts identical = {accepts_identical}")
        print(f"{'gate':>18}: {verdict.describe()}")
    return dict(
        dcp_size=group.size, tp_size=group.tp_size, **shape, temperature=args.temperature, model=args.model,
        draft=args.draft, tokens_identical=tokens_identical, accept_counts_identical=accepts_identical,
        accept_len=dict(dcp=dcp_arm["accept_len"], off=off_arm["accept_len"]),
        tokens_per_s=dict(dcp=dcp_arm["tokens_per_s"], off=off_arm["tokens_per_s"]),
        compile_s=dict(dcp=dcp_arm["compile_s"], off=off_arm["compile_s"]),
        compile_breakdown=dict(dcp=dcp_arm["compile_breakdown"], off=off_arm["compile_breakdown"]),
        new_tokens=[len(o.tokens) for o in dcp_out],
        finished_by=[o.finished_by for o in dcp_out],
        gate=verdict.as_dict(),
    )


def _on_ranks(rank_fn, args: argparse.Namespace, timeout: float):
    """``rank_fn(rank, size, args)`` as this torchrun rank, or on ranks spawned here; rank
    0's result (None on the other ranks under torchrun).  Options a rank refuses end the
    command with status 2 and the message."""
    from dcp_compile.runtime.launch import UsageError, spawn_ranks

    try:
        if "RANK" in os.environ:  # under torchrun: this process is one rank
            return rank_fn(int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", 1)), args)
        ranks = parallel.world_size(args)
        if args.device == "cuda" and torch.cuda.device_count() < ranks:
            raise SystemExit(f"--dcp {args.dcp} on cuda needs {args.dcp} GPUs, found {torch.cuda.device_count()}")
        return spawn_ranks(rank_fn, ranks, args, timeout=timeout)[0]
    except UsageError as error:
        print(f"dcp-compile {args.command}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _eval_rank(rank: int, size: int, args: argparse.Namespace) -> dict | None:
    from dcp_compile.commands import chat_prompts, training

    device = _device(args.device)
    group = parallel.join(args, device)
    result = training.measure_acceptance(
        args.spec, device=device, k=args.k, topk=args.topk, draft_tokens=args.draft_tokens, n_prompts=args.prompts,
        new_tokens=args.max_new_tokens, lowering=args.lowering, group=group, page_size=args.page_size,
        kv_tokens=args.kv_tokens, **chat_prompts.evaluation_prompts(args.spec, args.prompts),
    )
    return dict(result, layout=parallel.describe(group, "DCP {}")) if group.replica_rank == 0 else None


def eval_command(args: argparse.Namespace) -> int:
    """``dcp-compile eval``: the accept length, on the ranks of ``--tp`` / ``--dcp``."""
    result = _on_ranks(_eval_rank, args, timeout=3600)
    if result is not None:
        print(json.dumps(result))
    return 0


def demo(args: argparse.Namespace) -> int:
    summary = _on_ranks(_demo_rank, args, timeout=1800)
    if summary is not None:
        if args.json:
            print(json.dumps(summary))
        return 0 if summary["gate"]["passed"] else 1
    return 0


def _gate_arm(group, args, prompts, talk: bool, label: str) -> tuple[list, list]:
    from tqdm.auto import tqdm

    from dcp_compile.runtime.engine import generate_all

    max_seq_len = max(len(p) for p in prompts) + args.max_new_tokens + _shape(args)["k"] + 1
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
    from dcp_compile.commands import loading, training

    device = _device(args.device)
    group = parallel.join(args, device)
    talk = group.replica_rank == 0 and not args.json
    codec = None if args.spec.kind == "pair" else loading.codec(args.spec)
    prompts = training.held_out_prompts(args.prompts, args.prompt_bytes, seed=args.seed, codec=codec)
    dcp_tokens, dcp_accepted = _gate_arm(group, args, prompts, talk, f"DCP arm, {parallel.describe(group, 'size {}')}")
    if group.replica_rank != 0:
        return None
    off_tokens, off_accepted = _gate_arm(dcp.DCPGroup(1, 0, device, None), args, prompts, talk, "off arm")
    shape = _shape(args)
    verdict = gate.evaluate(dcp_tokens, dcp_accepted, off_tokens, off_accepted, k=shape["k"],
                            dtype=str(_dtype(args, device)).split(".")[-1])
    if talk:
        print(f"{parallel.describe(group, 'DCP size {}')} against the off arm, {_describe(args.spec)}, {_describe_shape(shape)}, "
              f"temperature {args.temperature}, {len(prompts)} held-out prompts x {args.max_new_tokens} new tokens")
        print(f"accept-count histogram, DCP: {verdict.histogram_dcp}; off: {verdict.histogram_off}")
        print(verdict.describe())
    return dict(verdict.as_dict(), dcp_size=group.size, tp_size=group.tp_size, **shape, temperature=args.temperature, model=args.model,
                draft=args.draft, prompts=len(prompts), max_new_tokens=args.max_new_tokens)


def gate_command(args: argparse.Namespace) -> int:
    summary = _on_ranks(_gate_rank, args, timeout=3600)
    if summary is None:
        return 0
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["passed"] else 1
