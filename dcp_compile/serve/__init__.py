"""``dcp-compile serve``: an OpenAI-compatible server over a ``SpecEngine``.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (each streamed or not, with
``usage`` and ``finish_reason``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Rank 0 steps the engine in its main thread (``serve.engine``) and starts the HTTP
process (Starlette on uvicorn, ``serve.http``); the other ranks run the engine's follower
loop.  The two processes of rank 0 speak through two pipes: requests and aborts one way,
each step's token ids the other.  The HTTP process does the rest of a request's host
work (``serve.frontend``: parsing, text, stop strings, streams), so none of it holds the
engine's interpreter between two steps.

The model's codec (``dcp_compile.text``) turns text into token ids and back: a prompt is
text or a list of token ids, chat messages go through the tokenizer's chat template,
and a completion's text streams through an incremental decoder.  The shipped byte-level
models read and write UTF-8 bytes and have no chat template (chat requests get a 400);
a Hugging Face model brings its tokenizer.  Generation ends at any of the model's EOS
ids (the engine's ``stop_ids``), at ``max_tokens`` or at a stop string.

Failure behaviour:
- a bad request (malformed JSON, a prompt longer than the cache, ``max_tokens < 1``, a
  field of the wrong type or one this server does not implement) gets a 400 naming the
  problem, and no other request notices;
- a client that disconnects mid-stream has its row freed at the next step;
- SIGTERM (or SIGINT): stop admitting, let running requests finish for up to
  ``--drain-seconds``, abort the rest, stop the followers, exit 0;
- a rank that dies or hangs: the step's collective fails (at once for a dead peer; after
  ``--collective-timeout`` for one that hangs while the batch is idle or between steps)
  or the step watchdog fires (``--step-timeout``, a rank that hangs inside a step); every
  open request gets an error, ``/health`` answers 503, and the server exits with status 1;
- the HTTP process that dies: the engine aborts what runs, stops the followers and exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

from dcp_compile.commands import parallel
from dcp_compile.runtime.pool import DEFAULT_PAGE_SIZE
from dcp_compile.runtime.engine import SamplingParams, SpecEngine
from dcp_compile.serve.engine import EngineLoop
from dcp_compile.text import Codec


def _build_engine(args: argparse.Namespace, group) -> tuple[SpecEngine, Codec]:
    """This rank's engine over ``--model`` (and ``--draft``), and the model's codec.  Every
    rank builds the same codec, so every engine stops on the same EOS ids."""
    import dcp_compile as dcp
    from dcp_compile.commands import loading

    spec = loading.resolve(args.model, args.draft)
    codec = loading.codec(spec)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if group.device.type == "cuda" else torch.float32)
    target, draft = loading.load(spec, max_batch=args.max_batch, max_seq_len=args.max_seq_len, device=group.device,
                                 dtype=dtype, native=parallel.native(args), paged=bool(args.page_size))
    parallel.shard(target, group)
    lowering = args.lowering or ("inductor" if group.device.type == "cuda" else "aot_eager")
    shape = {"k": args.k, "topk": args.topk, "draft_tokens": args.draft_tokens} if draft is not None else {"k": 0}
    decoder = dcp.SpecDecoder(target, draft, group, **shape, max_batch=args.max_batch,
                              max_seq_len=args.max_seq_len, temperature=args.temperature, seed=args.seed,
                              lowering=lowering, chunk_size=min(args.chunk_size, args.max_seq_len),
                              cuda_graphs=args.cuda_graphs and group.device.type == "cuda",
                              page_size=args.page_size, kv_tokens=args.kv_tokens or None,
                              memory_fraction=args.gpu_memory_utilization)
    if decoder.paging is not None and group.replica_rank == 0:
        shape = decoder.paging.shape
        print(f"dcp-compile serve: a KV pool of {shape.kv_tokens:,} tokens over {shape.dcp_size} rank(s), pages of "
              f"{shape.page_size} slots a rank", file=sys.stderr, flush=True)
    return SpecEngine(decoder, leader=True, stop_ids=codec.eos_ids, prefix_caching=args.prefix_caching,
                      preemption=args.preemption), codec


def _warm_up(engine: SpecEngine, codec: Codec) -> None:
    """Compile (and capture) every step graph before the first client waits for it.
    Rank 0 here and the followers in ``follow`` run this one request without the EOS
    ids, so that an early EOS cannot leave a graph to the first client."""
    stop_ids, engine.stop_ids = engine.stop_ids, frozenset()
    engine.add_request(codec.encode("def main():\n"), SamplingParams(max_new_tokens=2 * engine.k + 2))
    while engine.has_work():
        engine.step()
    engine.stop_ids = stop_ids


def _join(args: argparse.Namespace):
    device = args.device if args.device != "cuda" else None
    # Compiling ranks can drift apart by minutes; --collective-timeout applies to the
    # step plans once the warm-up is done, and --step-timeout to everything else.
    return parallel.join(args, device, timeout=timedelta(seconds=max(600.0, args.collective_timeout)))


def _follower(rank: int, size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    follow(args)


def follow(args: argparse.Namespace) -> None:
    """A rank other than 0: run rank 0's steps until it shuts the engine down.  Rank 0
    alone answers signals (a terminal's Ctrl-C or a SIGTERM reaches the whole process
    group): it drains and then stops the followers."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine, _ = _build_engine(args, _join(args))
    stop_ids, engine.stop_ids = engine.stop_ids, frozenset()
    try:
        # The first request is rank 0's warm-up (run without the EOS ids, as _warm_up
        # does); past it, a silent rank 0 is a failure.
        while not engine.stopped:
            engine.step()
            if engine.plan_timeout is None and engine.stats["finished"]:
                engine.plan_timeout = args.collective_timeout
                engine.stop_ids = stop_ids
    except BaseException as error:
        print(f"dcp-compile serve: rank {engine.group.replica_rank} stopped: {type(error).__name__}: {error}", file=sys.stderr,
              flush=True)
        os._exit(1)
    # Skip the process-group teardown: a peer that already left can make it wait.
    os._exit(0)


def serve(args: argparse.Namespace) -> int:
    """Rank 0 (spawning the other ranks itself when not under torchrun)."""
    import torch.multiprocessing as mp

    from dcp_compile.runtime.launch import free_port

    followers = []
    if "RANK" not in os.environ:
        ranks = parallel.world_size(args)
        if args.device == "cuda" and torch.cuda.device_count() < ranks:
            raise SystemExit(f"--dcp {args.dcp} on cuda needs {args.dcp} GPUs, found {torch.cuda.device_count()}")
        port = free_port()
        if ranks > 1:
            ctx = mp.get_context("spawn")
            followers = [ctx.Process(target=_follower, args=(r, ranks, port, args), daemon=True)
                         for r in range(1, ranks)]
            for p in followers:
                p.start()
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    elif int(os.environ["RANK"]) != 0:
        follow(args)
        return 0
    group = _join(args)
    engine, codec = _build_engine(args, group)
    tree = engine.decoder.tree_shape
    shape = f"k={engine.k}" if tree is None else f"tree k={tree.k} topk={tree.topk} draft_tokens={tree.draft_tokens}"
    print(f"dcp-compile serve: {args.model!r}" + (f" with draft {args.draft!r}" if args.draft else "")
          + f", {parallel.describe(group, 'DCP group of {}')} on {group.device.type}, max_batch {args.max_batch}, max_seq_len "
          f"{args.max_seq_len}, {shape}, EOS ids {sorted(codec.eos_ids)}; compiling", file=sys.stderr, flush=True)
    _warm_up(engine, codec)
    engine.plan_timeout = args.collective_timeout
    status = _serve_requests(args, engine, followers)
    print(f"dcp-compile serve: stopped{' after a failure' if status else ''}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _serve_requests(args: argparse.Namespace, engine: SpecEngine, followers: list) -> int:
    """Start the HTTP process and step the engine for it in this thread until SIGTERM
    (or SIGINT) has drained it or a step fails; the exit status."""
    import multiprocessing
    import signal

    from dcp_compile.serve.http import run_http

    requests_in, requests_out = multiprocessing.Pipe(duplex=False)
    events_in, events_out = multiprocessing.Pipe(duplex=False)
    http = multiprocessing.get_context("spawn").Process(
        target=run_http, args=(requests_out, events_in, engine.limits, args, served_model_name(args)),
        name="dcp-serve-http", daemon=True)
    http.start()
    requests_out.close()  # the HTTP process's ends: a dead HTTP process then reads as the pipe's end
    events_in.close()
    print(f"dcp-compile serve: the engine runs in pid {os.getpid()}, HTTP in pid {http.pid}", file=sys.stderr,
          flush=True)
    loop = EngineLoop(engine, requests_in, events_out, step_timeout=args.step_timeout,
                      admission_window=args.admission_window_ms / 1000)
    signal.signal(signal.SIGTERM, lambda *_: loop.drain(args.drain_seconds))
    signal.signal(signal.SIGINT, lambda *_: loop.drain(args.drain_seconds))
    failed = loop.run() is not None
    http.join(timeout=args.drain_seconds + 10)  # it answers what is open, then stops
    if http.is_alive():
        http.kill()
        failed = True
    for p in followers:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            failed = True
    return 1 if failed else 0


def served_model_name(args: argparse.Namespace) -> str:
    """What ``/v1/models`` lists and responses name: ``--served-model-name``, else the last
    part of ``--model``."""
    return args.served_model_name or Path(args.model).name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Serve's own flags; the draft's shape (``--k``, ``--topk``, ``--draft-tokens``) is the
    other decoding commands' and ``cli`` adds it."""
    from dcp_compile.runtime.generate import DEFAULT_CHUNK_SIZE

    parser.add_argument("--model", default="tiny-code", help="shipped model name, a `dcp-compile train` directory, or "
                        "a Hugging Face causal-LM directory (its tokenizer and chat template come with it)")
    parser.add_argument("--draft", help="an EAGLE3 or EAGLE-1 draft checkpoint directory for a Hugging Face --model "
                        "(default: none, one token per step)")
    parser.add_argument("--served-model-name", help="the model name the API reports (default: --model's last part)")
    parser.add_argument("--dcp", type=int, default=2, help="DCP group size when spawning ranks (default 2)")
    parallel.add_tp_argument(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=8, help="rows decoded together (default 8)")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="cache positions per row (default 1024)")
    parser.add_argument("--page-size", type=int, help="keep the target's KV in a pool of pages of this many slots a "
                        f"rank, and admit requests by the pages they need (default {DEFAULT_PAGE_SIZE} on CUDA, 0 on "
                        "CPU; 0: every row holds --max-seq-len)")
    parser.add_argument("--kv-tokens", type=int, default=0, help="the pool's capacity in tokens over the DCP group "
                        "(default on CUDA: what --gpu-memory-utilization leaves beside the weights, the draft and a "
                        "reserve; needed on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="the fraction of each GPU the weights, the draft, the pool and the reserve may take, when "
                             "--kv-tokens is not given (default 0.9)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="with --page-size: reuse the pages of prompt prefixes that earlier requests computed")
    parser.add_argument("--preemption", action="store_true",
                        help="with --page-size: admit a request by the pages of its prompt, grow it a page at a time, "
                             "and preempt (and later recompute) the newest request when the pool runs out; without it "
                             "a request is admitted by the pages of its whole length")
    parser.add_argument("--temperature", type=float, default=0.0, help="for requests that give none (default 0: greedy)")
    parser.add_argument("--seed", type=int, default=0, help="the shared sampling generator's seed")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--lowering", choices=("inductor", "aot_eager"), help="default: inductor on CUDA, aot_eager on CPU")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--drain-seconds", type=float, default=30.0, help="SIGTERM: how long running requests may finish")
    parser.add_argument("--collective-timeout", type=float, default=60.0, help="seconds a rank waits for the next step's plan before failing")
    parser.add_argument("--admission-window-ms", type=float, default=10.0,
                        help="an idle engine waits this long after a request arrives for more to share its first "
                             "prefill chunk (default 10; 0: admit at once)")
    parser.add_argument("--step-timeout", type=float, default=120.0, help="seconds before a stuck step ends the server")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("dcp", "max_batch", "max_seq_len", "k", "chunk_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    _check_pool(parser, args)
    if args.page_size and args.kv_tokens and args.max_seq_len > args.kv_tokens:
        parser.error(f"--max-seq-len {args.max_seq_len} is more than the pool's --kv-tokens {args.kv_tokens}: a request "
                     f"of --max-seq-len tokens could never run. Raise --kv-tokens or lower --max-seq-len")
    for name in ("drain_seconds", "collective_timeout", "step_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not 0 <= args.admission_window_ms <= 1000:
        parser.error(f"--admission-window-ms must be in [0, 1000], got {args.admission_window_ms}")
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        parser.error("`dcp-compile serve` needs the serve extra: pip install 'dcp-compile[serve]'")


def _check_pool(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--page-size`` defaults to a pool on CUDA, rows on CPU; a pool on CPU needs its size."""
    if args.page_size is None:
        args.page_size = DEFAULT_PAGE_SIZE if args.device == "cuda" else 0
    if args.page_size < 0 or args.kv_tokens < 0 or (args.kv_tokens and not args.page_size):
        parser.error(f"--page-size must be >= 0, and --kv-tokens >= 0 and given with a --page-size; got --page-size "
                     f"{args.page_size} and --kv-tokens {args.kv_tokens}")
    if args.page_size and not args.kv_tokens and args.device != "cuda":
        parser.error(f"--page-size {args.page_size} on CPU needs --kv-tokens (the pool's tokens over the DCP group): "
                     f"only a GPU's pool is sized from its free memory")
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.preemption and not args.page_size:
        parser.error("--preemption grows rows of a paged pool: give --page-size (and, on CPU, --kv-tokens)")


def start_in_background(options: list[str], port: int, log_path, start_seconds: float, *, cwd=None):
    """``dcp-compile serve --port PORT OPTIONS`` in a subprocess, its output in
    ``log_path``; returns the process once ``/health`` answers 200 (for scripts and tests
    that drive a server).  Raises with the log's tail if the server exits or stays silent
    past ``start_seconds`` (it is killed then).  ``cwd``: where it runs (``python -m``
    puts that directory ahead of ``PYTHONPATH``)."""
    import subprocess
    import time
    import urllib.error
    import urllib.request

    log_path = Path(log_path)
    command = [sys.executable, "-m", "dcp_compile.cli", "serve", "--port", str(port), *options]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log, cwd=cwd)
    deadline = time.monotonic() + start_seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return process
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    process.kill()
    raise RuntimeError(f"the server did not come up in {start_seconds:.0f}s:\n{log_path.read_text()[-3000:]}")


def stop_in_background(process, seconds: float = 60) -> None:
    """SIGTERM (the server drains), then a kill if it is still there after ``seconds``."""
    import signal
    import subprocess

    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.kill()
