"""What the paged pool buys: the same KV bytes as rows of ``max_seq_len`` or as a pool.

    python3 benchmarks/bench_pool_capacity.py --out $OUT/pool_capacity.json     # one GPU, 8B-shaped layers
    python3 benchmarks/bench_pool_capacity.py --small --device cpu              # the script itself, on CPU

One GPU (a group of one), a Llama-3-8B-shaped target (``--layers`` of its 32, random bf16
weights), no draft (one token a step, so both arms emit the same tokens a step), CUDA
graphs.  A long-tailed trace: ``--requests`` prompts whose lengths are log-normal with a
median of ``--median`` tokens, clipped to ``[--shortest, --longest]``, each asking for
``--new`` tokens; every request arrives at once.  Two arms hold the same KV bytes:

- **rows**: ``kv_tokens // max_seq_len`` rows of ``max_seq_len`` slots (the longest request);
- **pool**: ``--pool-rows`` rows over a pool of ``kv_tokens`` tokens in pages of ``--page-size``:
  a request is admitted when the pool has the pages for its whole length.

Per arm: wall time from the first step to the last token, generated tokens / s, prompt and
generated tokens / s, the mean number of requests running per step, and the steps in which a
request waited while the arm ran fewer requests than its rows (admission stalls: for rows, the
rows were all taken; for the pool, its pages); where the time went: the steps that fed prompt
chunks and their seconds, the median decode step, the steps' device time.  Both arms compile before the clock starts (a
warm-up request).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import time

import torch

import dcp_compile as dcp
from dcp_compile.models import LlamaConfig
from dcp_compile.models.llama import llama3_8b_shape
from dcp_compile.runtime.engine import SamplingParams, SpecEngine
from _report import leave, log, parse_trace_arguments, random_llama, report

SMALL = LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128)


def trace(args) -> list[int]:
    """Prompt lengths: log-normal around the median (sigma 1), clipped."""
    gen = torch.Generator().manual_seed(args.seed)
    draws = torch.randn(args.requests, generator=gen) * args.sigma + math.log(args.median)
    return [int(min(max(math.exp(float(d)), args.shortest), args.longest)) for d in draws]


def run_arm(cfg: LlamaConfig, arm: str, args, lengths: list[int], device) -> dict:
    max_seq_len = args.longest + args.new + 1
    rows = args.kv_tokens // max_seq_len if arm == "rows" else args.pool_rows
    pool = dict(page_size=args.page_size, kv_tokens=args.kv_tokens) if arm == "pool" else {}
    model = random_llama(dataclasses.replace(cfg, max_batch=rows, max_seq_len=max_seq_len), device)
    cuda = device.type == "cuda"
    decoder = dcp.SpecDecoder(model, None, dcp.init_group(device.type), k=0, max_batch=rows, max_seq_len=max_seq_len,
                              lowering="inductor" if cuda else "aot_eager", cuda_graphs=cuda,
                              chunk_size=args.chunk_size, **pool)
    log(f"{arm}: {rows} rows, compiling")
    dcp.generate_all(decoder, [[1] * 8] * rows, 4)  # every graph compiled and captured before the clock
    engine = SpecEngine(decoder, prefill_chunks_per_step=None)
    gen = torch.Generator().manual_seed(args.seed + 1)
    for n in lengths:
        engine.add_request(torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist(),
                           SamplingParams(max_new_tokens=args.new))
    running, stalls, steps, tokens, prefill_steps, prefill_seconds, decode_seconds = [], 0, 0, 0, 0, 0.0, []
    started = time.perf_counter()
    while engine.has_work():
        prefilling, admitted = any(r is not None and not r.decoding for r in engine.rows), engine.stats["admitted"]
        began = time.perf_counter()
        for event in engine.step().values():
            tokens += len(event.tokens)
        took = time.perf_counter() - began
        prefilling = prefilling or engine.stats["admitted"] > admitted  # a newcomer's prompt is fed in its first step
        prefill_steps, prefill_seconds = prefill_steps + prefilling, prefill_seconds + took * prefilling
        if not prefilling:
            decode_seconds.append(took)
        steps += 1
        running.append(engine.running)
        stalls += bool(engine.waiting) and engine.running < rows
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    result = dict(arm=arm, rows=rows, kv_tokens=args.kv_tokens, seconds=seconds, steps=steps, generated=tokens,
                  generated_per_s=tokens / seconds, all_tokens_per_s=(tokens + sum(lengths)) / seconds,
                  mean_running=sum(running) / len(running), admission_stalls=stalls,
                  # where the time went: steps that fed prompt chunks (each a [rows, chunk] graph
                  # however few rows still prefill) and the decode steps between them
                  prefill_steps=prefill_steps, prefill_step_seconds=prefill_seconds,
                  decode_step_median_ms=1e3 * statistics.median(decode_seconds) if decode_seconds else None,
                  device_step_seconds=engine.stats["device_step_seconds"])
    log(f"{arm}: " + json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 8B shape's 32 (default 4)")
    parser.add_argument("--kv-tokens", type=int, default=1 << 20, help="both arms' KV, in tokens (default 1,048,576)")
    parser.add_argument("--pool-rows", type=int, default=64, help="rows the pool arm runs at most (default 64)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--median", type=int, default=4096)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--shortest", type=int, default=1024)
    parser.add_argument("--longest", type=int, default=65536)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--arms", nargs="+", choices=("rows", "pool"), default=["rows", "pool"])
    args = parse_trace_arguments(parser)
    device = torch.device(args.device)
    if args.small:
        args.kv_tokens, args.pool_rows, args.requests, args.median = 4 * 300, 8, 12, 48
        args.shortest, args.longest, args.new, args.chunk_size, args.page_size = 16, 256, 16, 64, 8
    cfg = SMALL if args.small else dataclasses.replace(llama3_8b_shape(aux_layers=()), n_layers=args.layers)
    lengths = trace(args)
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               layers=cfg.n_layers, prompt_tokens=sum(lengths), median_prompt=sorted(lengths)[len(lengths) // 2])
    results = []
    for arm in args.arms:
        results.append(run_arm(cfg, arm, args, lengths, device))
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if len(results) == 2:
        env["pool_over_rows_generated_per_s"] = results[1]["generated_per_s"] / results[0]["generated_per_s"]
    report(dict(env=env, arms=results), args.out)
    leave()


if __name__ == "__main__":
    main()
