"""CUDA-graph replay of the speculative loop over NCCL, with the shipped tiny-code pair.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout -k 10 300 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/gpu_cuda_graphs.py --json out.json

Three runs of the same prompts (bf16, Inductor, EAGLE3 chain k=4, greedy):

- DCP=2 with ``cuda_graphs=True`` (verify, commit, draft extend and step captured, the
  target's all-gathers inside the verify graph), generating twice;
- DCP=2 without graphs;
- the off arm (size 1, rank 0) with graphs.

Checks: identical tokens and accept counts across the three; the second generation adds
no capture and no compile (Dynamo's unique-graph counter and the runners' capture
counters are read before and after).  Reports tokens/s of each, second generation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import dcp_compile as dcp
from dcp_compile.models.pretrained import load_pair
from dcp_compile.runtime.spec import SpecDecoder
from _report import leave, parse_with_watchdog, report

PROMPTS = [b"def fibonacci(n):\n", b"import os\n\n\ndef walk(root):\n", b"class Stack:\n    def push(self, item):\n",
           b"    for line in lines:\n        if ", b"if __name__ == '__main__':\n", b"import re\n\n_WORD = ",
           b"def read(path):\n    with open(path) as f:\n", b"    return sorted("]
K, NEW = 4, 96


def run(group, cuda_graphs: bool, comm: str) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    prompts = [list(p) for p in PROMPTS]
    max_seq_len = max(map(len, prompts)) + NEW + K + 1
    target, draft = load_pair("tiny-code", max_batch=len(prompts), max_seq_len=max_seq_len, device=group.device,
                              dtype=torch.bfloat16)
    decoder = SpecDecoder(target, draft, group, k=K, max_batch=len(prompts), max_seq_len=max_seq_len,
                          cuda_graphs=cuda_graphs, comm=comm, check_ranks=True)
    dcp.generate_all(decoder, prompts, NEW)
    print(f"[rank {group.rank} {time.strftime('%H:%M:%S')}] first generation done", file=sys.stderr, flush=True)
    graphs_before = counters["stats"]["unique_graphs"]
    captures_before = [r.captures for r in decoder.graph_runners]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = dcp.generate_all(decoder, prompts, NEW)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return dict(
        tokens=[o.tokens for o in outputs], accepted=[o.accepted for o in outputs],
        tokens_per_s=sum(len(o.tokens) for o in outputs) / seconds,
        new_compiles=counters["stats"]["unique_graphs"] - graphs_before,
        new_captures=[r.captures for r in decoder.graph_runners] != captures_before,
        captures=[r.captures for r in decoder.graph_runners], replays=[r.replays for r in decoder.graph_runners],
        accept_len=sum(a + 1 for o in outputs for a in o.accepted) / sum(len(o.accepted) for o in outputs),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parse_with_watchdog(parser)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    group = dcp.init_group(device)
    results = {}
    for name, graphs, comm in (("dcp_eager_steps", False, "ag"), ("dcp_graphs", True, "ag"), ("dcp_graphs_a2a", True, "a2a")):
        print(f"[rank {group.rank} {time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)
        try:
            results[name] = run(group, graphs, comm)
            r = results[name]
            print(f"[rank {group.rank} {time.strftime('%H:%M:%S')}] {name}: {r['tokens_per_s']:.1f} tokens/s, accept "
                  f"length {r['accept_len']:.3f}, captures {r['captures']}", file=sys.stderr, flush=True)
        except Exception as err:
            results[name] = dict(error=f"{type(err).__name__}: {err}"[:500])
            print(f"[rank {group.rank}] {name} failed: {results[name]['error']}", file=sys.stderr, flush=True)
    if group.rank == 0:
        try:
            results["off_graphs"] = run(dcp.DCPGroup(1, 0, device, None), True, "ag")
        except Exception as err:
            results["off_graphs"] = dict(error=f"{type(err).__name__}: {err}"[:500])
        ok = {k: v for k, v in results.items() if "error" not in v}
        reference = ok.get("off_graphs")
        summary = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__, dcp_size=group.size)
        for name, r in results.items():
            if "error" in r:
                summary[name] = r
                continue
            summary[name] = dict(
                tokens_identical_to_off=None if reference is None else r["tokens"] == reference["tokens"],
                accepts_identical_to_off=None if reference is None else r["accepted"] == reference["accepted"],
                tokens_per_s=round(r["tokens_per_s"], 1), accept_len=round(r["accept_len"], 3),
                new_compiles_in_second_run=r["new_compiles"], new_captures_in_second_run=r["new_captures"],
                captures=r["captures"], replays=r["replays"],
            )
        report(summary, args.json)
    leave()


if __name__ == "__main__":
    main()
