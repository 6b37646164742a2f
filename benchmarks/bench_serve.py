"""`dcp-compile serve` under a saturating streaming load against the offline engine.

    python3 benchmarks/bench_serve.py --device cuda --out $OUT/serve.json     # one GPU, DCP=1
    torchrun is not used: the server spawns its own ranks (--dcp N, one GPU each).
    python3 benchmarks/bench_serve.py --device cpu --requests 8 --max-tokens 16   # the script itself

Both arms decode the same requests (held-out code prompts of mixed length, a fixed
``max_tokens``, EOS honoured) with the same shapes (``--max-batch`` rows, k=4, the
shipped pair, bf16 on CUDA, CUDA graphs):

- **offline**: one ``SpecEngine`` in this process, every request queued at once, stepped
  until done: generated tokens per second;
- **server**: ``dcp-compile serve`` in a subprocess, ``--concurrency`` streaming clients
  (as many as rows, so the batch stays full): tokens per second, time to first token and
  inter-token latency;

and their ratio (goal: the server at least 90% of the offline engine).  Steady state:
the server's Dynamo compile count and CUDA-graph capture count after the load are
those after its warm-up (``/metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load_test  # noqa: E402


def offline(args, requests) -> dict:
    import dcp_compile as dcp
    from dcp_compile.models.pretrained import load_pair
    from dcp_compile.runtime.engine import SamplingParams, SpecEngine

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, draft = load_pair("tiny-code", max_batch=args.max_batch, max_seq_len=args.max_seq_len, device=device,
                              dtype=dtype)
    decoder = dcp.SpecDecoder(target, draft, dcp.DCPGroup(1, 0, device, None), k=4, max_batch=args.max_batch,
                              max_seq_len=args.max_seq_len, cuda_graphs=device.type == "cuda",
                              lowering="inductor" if device.type == "cuda" else "aot_eager")

    def run_all() -> tuple[float, int]:
        engine = SpecEngine(decoder)
        for r in requests:
            engine.add_request(r["prompt"], SamplingParams(max_new_tokens=r["max_tokens"], eos_id=0))
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        return time.perf_counter() - start, engine.stats["tokens"]

    run_all()  # compiles and captures
    times = [run_all() for _ in range(args.reps)]
    seconds = sorted(t for t, _ in times)[len(times) // 2]
    tokens = times[0][1]
    return dict(seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds)


def server(args, requests) -> dict:
    from dcp_compile.runtime.launch import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    options = ["--dcp", str(args.dcp), "--device", args.device, "--max-batch", str(args.max_batch), "--max-seq-len",
               str(args.max_seq_len)]
    process = load_test.start_server(options, port, args.server_log, args.start_seconds)
    try:
        # a first pass warms the server's prefill for every prompt width bucket
        asyncio.run(load_test.run_load(url, requests[: args.max_batch], args.concurrency))
        before = httpx.get(f"{url}/metrics").text
        runs = [asyncio.run(load_test.run_load(url, requests, args.concurrency))["summary"] for _ in range(args.reps)]
        after = httpx.get(f"{url}/metrics").text
    finally:
        load_test.stop_server(process)
    best = sorted(runs, key=lambda s: s["tokens_per_s"])[len(runs) // 2]
    pick = lambda text, name: next(line.split()[1] for line in text.splitlines() if line.startswith(name + " "))  # noqa: E731
    steady = {name: (pick(before, name), pick(after, name)) for name in ("dcp_compiles_total", "dcp_graph_captures_total")}
    return dict(best, runs=runs, steady_state=steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--start-seconds", type=float, default=300)
    parser.add_argument("--server-log", default="/tmp/bench_serve_server.log")
    parser.add_argument("--out")
    args = parser.parse_args()
    args.concurrency = args.concurrency or args.max_batch
    requests = load_test.make_requests(args.requests, seed=0, max_tokens=(args.max_tokens, args.max_tokens))
    result = dict(env=dict(torch=torch.__version__, device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu"),
                  config=dict(vars(args)))
    result["offline"] = offline(args, requests)
    print(f"offline: {json.dumps(result['offline'])}", flush=True)
    result["server"] = server(args, requests)
    print(f"server: {json.dumps(result['server'])}", flush=True)
    result["server_over_offline"] = result["server"]["tokens_per_s"] / result["offline"]["tokens_per_s"]
    print(f"server / offline tokens per second: {result['server_over_offline']:.3f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
