"""``dcp-compile serve`` on one GPU with its defaults: a paged pool sized from the free memory.

    python3 benchmarks/gpu_serve_pool.py --out $OUT/serve_pool.json      # one GPU

Starts the server with the shipped model and no pool flags, then: the pool's size it printed
and its ``/metrics`` capacity; the device's memory in use (``torch.cuda.mem_get_info``, seen
from this process, so every process on the card) against ``--gpu-memory-utilization`` of it;
one prompt sent twice through ``/v1/completions`` (the second served from the prefix cache:
``cached_tokens`` and the same text).
"""

from __future__ import annotations

import argparse
import json
import re
import urllib.request
from pathlib import Path

import torch

from _report import leave, log, parse_with_watchdog, report
from dcp_compile.serve import start_in_background


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--log", default="/tmp/serve_pool.log")
    parser.add_argument("--out")
    args = parse_with_watchdog(parser)
    log("starting the server (compiles and captures before /health answers)")
    server = start_in_background(["--device", "cuda", "--dcp", "1", "--max-seq-len", str(args.max_seq_len),
                                  "--max-batch", "8", "--chunk-size", "256"], args.port, args.log, 400)
    try:
        free, total = torch.cuda.mem_get_info()
        printed = re.search(r"a KV pool of ([\d,]+) tokens", Path(args.log).read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/metrics", timeout=30) as reply:
            metrics = reply.read().decode()
        capacity = re.search(r"^dcp_kv_pool_capacity_tokens (\S+)", metrics, re.M)
        prompt = "def fibonacci(n):\n    " * 40
        first, second = (post(args.port, dict(model="tiny-code", prompt=prompt, max_tokens=32)) for _ in range(2))
        result = dict(
            pool_tokens_printed=int(printed.group(1).replace(",", "")) if printed else None,
            pool_tokens_metric=float(capacity.group(1)) if capacity else None,
            device_in_use_fraction=(total - free) / total, device=torch.cuda.get_device_name(),
            same_text=first["choices"][0]["text"] == second["choices"][0]["text"],
            cached_tokens=[r["usage"].get("prompt_tokens_details", {}).get("cached_tokens") for r in (first, second)],
            prompt_tokens=first["usage"]["prompt_tokens"],
        )
        log(json.dumps(result))
        report(result, args.out)
    finally:
        server.terminate()
        server.wait(timeout=60)
    leave()


if __name__ == "__main__":
    main()
