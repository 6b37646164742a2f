"""`dcp-compile serve` under a saturating streaming load against the offline engine.

    python3 benchmarks/bench_serve.py --device cuda --out $OUT/serve.json     # one GPU, DCP=1
    torchrun is not used: the server spawns its own ranks (--dcp N, one GPU each).
    python3 benchmarks/bench_serve.py --device cpu --requests 8 --max-tokens 16   # the script itself
    # a Llama-3-8B-shaped Hugging Face directory (random weights, written once) and an
    # EAGLE3 draft in the published layout; its load time and peak host memory; and
    # transformers' own generate() beside the two arms:
    python3 benchmarks/bench_serve.py --device cuda --write-llama3-8b /tmp/llama3-8b --load-probe --hf-generate \
        --chunk-size 256 --out $OUT/serve-8b.json

Both arms decode the same requests (held-out code prompts of mixed length, a fixed
``max_tokens``, EOS honoured) with the same shapes (``--max-batch`` rows, k=4,
``--model`` / ``--draft``: the shipped pair by default; bf16 on CUDA, CUDA graphs):

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
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load_test  # noqa: E402


LOOP_KEYS = ("while_running_seconds", "while_running_slow", "between_steps_seconds", "between_steps_slow")
"""The server's engine loop's own host time (``serve.engine.EngineLoop.timings``)."""
DEVICE_KEYS = ("device_step_seconds", "device_wait_seconds", "device_waits", "device_long_waits",
               "device_long_wait_seconds")


def offline(args, requests) -> dict:
    import dcp_compile as dcp
    from dcp_compile.commands import loading
    from dcp_compile.runtime.engine import SamplingParams, SpecEngine

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = loading.resolve(args.model, args.draft)
    started = time.perf_counter()
    target, draft = loading.load(spec, max_batch=args.max_batch, max_seq_len=args.max_seq_len, device=device,
                                 dtype=dtype)
    load_s = time.perf_counter() - started
    stops = loading.codec(spec).eos_ids
    decoder = dcp.SpecDecoder(target, draft, dcp.DCPGroup(1, 0, device, None), k=args.k if draft is not None else 0,
                              max_batch=args.max_batch, max_seq_len=args.max_seq_len, cuda_graphs=device.type == "cuda",
                              lowering="inductor" if device.type == "cuda" else "aot_eager",
                              chunk_size=min(args.chunk_size, args.max_seq_len))

    def run_all() -> tuple[float, int]:
        engine = SpecEngine(decoder, stop_ids=stops)
        for r in requests:
            engine.add_request(r["prompt"], SamplingParams(max_new_tokens=r["max_tokens"]))
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        seconds = time.perf_counter() - start
        accept.append(engine.stats["accepted"] / max(1, engine.stats["row_steps"]) + 1)
        device_times.append({key: engine.stats[key] for key in DEVICE_KEYS})
        return seconds, engine.stats["tokens"]

    accept: list[float] = []
    device_times: list[dict] = []

    started = time.perf_counter()
    run_all()  # compiles and captures
    compile_s = time.perf_counter() - started
    times = [run_all() for _ in range(args.reps)]
    seconds = statistics.median(t for t, _ in times)
    tokens = times[0][1]
    last = device_times[-1]
    result = dict(seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds, load_s=load_s, accept_len=accept[-1],
                  first_pass_s=compile_s, all_tokens_per_s=[tok / t for t, tok in times],
                  device_idle=idle_share(*(last[key] for key in DEVICE_KEYS)))
    del decoder, target, draft
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def server(args, requests) -> dict:
    from dcp_compile.runtime.launch import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    options = ["--dcp", str(args.dcp), "--device", args.device, "--max-batch", str(args.max_batch), "--max-seq-len",
               str(args.max_seq_len), "--model", args.model, "--k", str(args.k), "--chunk-size", str(args.chunk_size)]
    options += ["--draft", args.draft] if args.draft else []
    options += args.server_args.split() if args.server_args else []
    process = load_test.start_server(options, port, args.server_log, args.start_seconds, args.server_tree)
    try:
        # a first pass warms the server's prefill for every prompt width bucket
        asyncio.run(load_test.run_load(url, requests[: args.max_batch], args.concurrency))
        before = httpx.get(f"{url}/metrics").text
        runs = [asyncio.run(load_test.run_load(url, requests, args.concurrency))["summary"] for _ in range(args.reps)]
        after = httpx.get(f"{url}/metrics").text
    finally:
        load_test.stop_server(process)
    # The pass of median throughput (for an even count, the mean of the middle two).
    best = dict(sorted(runs, key=lambda s: s["tokens_per_s"])[len(runs) // 2])
    best["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
    pick = lambda text, name: next(line.split()[1] for line in text.splitlines() if line.startswith(name + " "))  # noqa: E731
    steady = {name: (pick(before, name), pick(after, name)) for name in ("dcp_compiles_total", "dcp_graph_captures_total")}
    # A counter the server does not report (an older version's, --server-tree) is None.
    spent = lambda name: (float(pick(after, name)) - float(pick(before, name))  # noqa: E731
                          if f"\n{name} " in f"\n{after}" else None)
    idle = idle_share(*(spent(f"dcp_{key}_total") for key in DEVICE_KEYS))
    loop = {name: spent(f"dcp_loop_{name}_total") for name in LOOP_KEYS}
    return dict(best, runs=runs, steady_state=steady, device_idle=idle, engine_loop=loop)


def idle_share(step_seconds: float, wait_seconds: float, waits: float | None, long_waits: float | None,
               long_wait_seconds: float | None) -> dict:
    """The device's idle time between steps launched back to back, as a share of the time
    those steps spanned: what the host adds to the step's critical path; and the part of it
    in pauses over 100 us (``SpecEngine.stats``; None where a server does not count them)."""
    span = step_seconds + wait_seconds
    share = lambda seconds: seconds / span if span and seconds is not None else None  # noqa: E731
    count = lambda n: None if n is None else int(n)  # noqa: E731
    return dict(device_step_s=step_seconds, device_wait_s=wait_seconds, wait_share=share(wait_seconds),
                waits=count(waits), long_waits=count(long_waits), long_wait_s=long_wait_seconds,
                long_wait_share=share(long_wait_seconds))


def hf_generate(args, requests) -> dict:
    """Transformers' own ``generate()`` on the same directory and GPU: the requests in
    static batches of ``--max-batch`` rows, left-padded, greedy, the same ``max_tokens``."""
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    placement = {"device_map": {"": device}} if device.type == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa",
                                                 local_files_only=True, **placement).eval()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    pad = 0

    def batch_tokens(batch) -> int:
        width = max(len(r["prompt"]) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r["prompt"])) + r["prompt"] for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r["prompt"])) + [1] * len(r["prompt"]) for r in batch], device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(r["max_tokens"] for r in batch),
                                 do_sample=False, pad_token_id=pad)
        return int((out[:, width:] != pad).sum())

    batches = [requests[i:i + args.max_batch] for i in range(0, len(requests), args.max_batch)]
    batch_tokens(batches[0])  # warm-up
    runs = []
    for _ in range(args.reps):
        sync()
        start = time.perf_counter()
        tokens = sum(batch_tokens(b) for b in batches)
        sync()
        runs.append((time.perf_counter() - start, tokens))
    seconds = statistics.median(t for t, _ in runs)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(seconds=seconds, tokens=runs[0][1], tokens_per_s=runs[0][1] / seconds,
                all_tokens_per_s=[tok / t for t, tok in runs], cache="DynamicCache (generate's default)")


LOAD_PROBE = """
import json, sys, threading, time
import torch
from dcp_compile.commands import loading

peaks = dict(RssAnon=0, RssFile=0)
stop = threading.Event()

def sample():
    # ru_maxrss counts the checkpoint's mapped file pages too; anonymous memory is what a
    # copy of the weights in host memory would take.
    while not stop.wait(0.02):
        for line in open("/proc/self/status"):
            key = line.split(":")[0]
            if key in peaks:
                peaks[key] = max(peaks[key], int(line.split()[1]))

threading.Thread(target=sample, daemon=True).start()
spec = loading.resolve(sys.argv[1], sys.argv[2])
start = time.perf_counter()
target, draft = loading.load(spec, max_batch=int(sys.argv[3]), max_seq_len=int(sys.argv[4]), device="cuda",
                             dtype=torch.bfloat16)
torch.cuda.synchronize()
seconds = time.perf_counter() - start
stop.set()
print(json.dumps(dict(load_s=seconds, peak_host_anon_gib=peaks["RssAnon"] / 2**20,
                      peak_host_file_mapped_gib=peaks["RssFile"] / 2**20,
                      gpu_allocated_gib=torch.cuda.memory_allocated() / 2**30)))
"""


def load_probe(args) -> dict:
    """Load time and peak host memory of ``--model`` + ``--draft`` onto the GPU, in a
    fresh process (its peak resident set is the load's alone)."""
    import subprocess

    files = sorted(Path(args.model).glob("*.safetensors"))
    proc = subprocess.run([sys.executable, "-c", LOAD_PROBE, args.model, args.draft, str(args.max_batch),
                           str(args.max_seq_len)], capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(result, checkpoint_gib=sum(f.stat().st_size for f in files) / 2**30, shards=len(files))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default="tiny-code", help="a shipped name, a train directory or an HF directory")
    parser.add_argument("--draft", help="the EAGLE draft directory of an HF --model")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--write-llama3-8b", metavar="DIR",
                        help="write (once) a random Llama-3-8B-shaped HF directory and an EAGLE3 draft under DIR, "
                             "and serve them")
    parser.add_argument("--load-probe", action="store_true", help="time the load and record its peak host memory")
    parser.add_argument("--hf-generate", action="store_true", help="also time transformers' own generate()")
    parser.add_argument("--arms", default="offline,server", help="which of offline,server to run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--server-args", help="more `dcp-compile serve` options, e.g. '--admission-window-ms 0'")
    parser.add_argument("--server-tree", metavar="DIR",
                        help="serve with the dcp_compile package in DIR (another version's, side by side)")
    parser.add_argument("--start-seconds", type=float, default=300)
    parser.add_argument("--server-log", default="/tmp/bench_serve_server.log")
    parser.add_argument("--out")
    args = parser.parse_args()
    args.concurrency = args.concurrency or args.max_batch
    requests = load_test.make_requests(args.requests, seed=0, max_tokens=(args.max_tokens, args.max_tokens))
    import transformers
    import triton

    result = dict(env=dict(torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                           device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu"),
                  config=dict(vars(args)))

    def report(name: str, value) -> None:
        result[name] = value
        print(f"{name}: {json.dumps(value)}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    if args.write_llama3_8b:
        import random_hf

        report("written", random_hf.write_llama3_8b(Path(args.write_llama3_8b)))
        args.model, args.draft = str(Path(args.write_llama3_8b) / "target"), str(Path(args.write_llama3_8b) / "draft")
    if args.load_probe:
        report("load", load_probe(args))
    if args.hf_generate:
        report("hf_generate", hf_generate(args, requests))
    arms = args.arms.split(",")
    if "offline" in arms:
        report("offline", offline(args, requests))
    if "server" in arms:
        report("server", server(args, requests))
    if "offline" in arms and "server" in arms:
        result["server_over_offline"] = result["server"]["tokens_per_s"] / result["offline"]["tokens_per_s"]
        print(f"server / offline tokens per second: {result['server_over_offline']:.3f}", flush=True)
    if "hf_generate" in result and "server" in result:
        result["server_over_hf_generate"] = result["server"]["tokens_per_s"] / result["hf_generate"]["tokens_per_s"]
        print(f"server / transformers generate() tokens per second: {result['server_over_hf_generate']:.3f}",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
