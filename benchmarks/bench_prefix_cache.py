"""What prefix caching saves on a multi-turn chat trace: prefill tokens computed and time to first token.

    python3 benchmarks/bench_prefix_cache.py --out $OUT/prefix_cache.json     # one GPU, 8B-shaped layers
    python3 benchmarks/bench_prefix_cache.py --small --device cpu              # the script itself, on CPU

One GPU (a group of one), a Llama-3-8B-shaped target (``--layers`` of its 32, random bf16
weights), no draft, a paged pool, CUDA graphs.  The trace: ``--conversations``
conversations of ``--turns`` turns, all behind one system prompt of ``--system`` tokens.
A turn's prompt is the system prompt, every earlier turn (its user message and the reply
the model gave) and a new user message of ``--user-min``..``--user-max`` tokens; it asks for
``--new`` tokens.  Every conversation starts at once, and sends its next turn as soon as
the last one's reply is in.  Two arms on the same compiled decoder, one engine each:
``SpecEngine(prefix_caching=False)`` and ``prefix_caching=True``.

Per arm: prefill tokens computed (prompt tokens minus those served from the cache), the
cache's hits, time to first token (from ``add_request`` to the step that returns the
request's first token: median and p90), wall time and generated tokens / s.  Both arms
must give the same replies (a hit computes what a miss does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import dcp_compile as dcp
from dcp_compile.models import LlamaConfig
from dcp_compile.models.llama import llama3_8b_shape
from dcp_compile.runtime.engine import SamplingParams, SpecEngine
from _report import leave, log, parse_trace_arguments, random_llama, report

SMALL = LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128)


def user_messages(args, vocab: int) -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(args.seed)
    return [[torch.randint(0, vocab, (int(torch.randint(args.user_min, args.user_max + 1, (), generator=gen)),),
                           generator=gen).tolist() for _ in range(args.turns)] for _ in range(args.conversations)]


def run_arm(decoder, cached: bool, args, system: list[int], users: list[list[list[int]]]) -> dict:
    engine = SpecEngine(decoder, prefix_caching=cached)
    history = [list(system) for _ in users]
    turn = [0] * len(users)
    owner, sent_at, ttft, replies = {}, {}, [], [[] for _ in users]
    prompt_tokens = cached_tokens = 0

    def send(conversation: int) -> None:
        nonlocal prompt_tokens
        history[conversation] += users[conversation][turn[conversation]]
        rid = engine.add_request(history[conversation], SamplingParams(max_new_tokens=args.new))
        owner[rid], sent_at[rid] = conversation, time.perf_counter()
        prompt_tokens += len(history[conversation])

    for conversation in range(len(users)):
        send(conversation)
    started = time.perf_counter()
    generated = 0
    while engine.has_work():
        for rid, event in engine.step().items():
            conversation = owner[rid]
            if event.cached_tokens is not None:
                ttft.append(time.perf_counter() - sent_at[rid])
                cached_tokens += event.cached_tokens
            history[conversation] += event.tokens
            replies[conversation].append(event.tokens)
            generated += len(event.tokens)
            if event.finished_by:
                turn[conversation] += 1
                if turn[conversation] < args.turns:
                    send(conversation)
    seconds = time.perf_counter() - started
    ttft.sort()
    result = dict(arm="cache" if cached else "no cache", requests=len(ttft), prompt_tokens=prompt_tokens,
                  cached_tokens=cached_tokens, prefill_tokens_computed=prompt_tokens - cached_tokens,
                  ttft_median_ms=1e3 * statistics.median(ttft), ttft_p90_ms=1e3 * ttft[int(0.9 * (len(ttft) - 1))],
                  seconds=seconds, generated_per_s=generated / seconds, engine_hit_tokens=engine.stats["prefix_hit_tokens"])
    log(json.dumps(result))
    return result, [sum(r, []) for r in replies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 8B shape's 32 (default 4)")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system", type=int, default=2048, help="system prompt tokens (default 2048)")
    parser.add_argument("--user-min", type=int, default=64)
    parser.add_argument("--user-max", type=int, default=256)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--kv-tokens", type=int, default=1 << 18, help="the pool's tokens (default 262,144)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=512)
    args = parse_trace_arguments(parser)
    device = torch.device(args.device)
    if args.small:
        args.conversations, args.turns, args.system, args.user_min, args.user_max, args.new = 4, 3, 40, 6, 12, 8
        args.max_batch, args.max_seq_len, args.kv_tokens, args.page_size, args.chunk_size = 3, 128, 1024, 8, 16
    cfg = SMALL if args.small else dataclasses.replace(llama3_8b_shape(aux_layers=()), n_layers=args.layers)
    cuda = device.type == "cuda"
    model = random_llama(dataclasses.replace(cfg, max_batch=args.max_batch, max_seq_len=args.max_seq_len), device)
    decoder = dcp.SpecDecoder(model, None, dcp.init_group(device.type), k=0, max_batch=args.max_batch,
                              max_seq_len=args.max_seq_len, lowering="inductor" if cuda else "aot_eager",
                              cuda_graphs=cuda, chunk_size=args.chunk_size, page_size=args.page_size,
                              kv_tokens=args.kv_tokens)
    log("compiling")
    dcp.generate_all(decoder, [[1] * 8] * args.max_batch, 4)  # every graph compiled and captured before the clock
    gen = torch.Generator().manual_seed(args.seed + 1)
    system = torch.randint(0, cfg.vocab_size, (args.system,), generator=gen).tolist()
    users = user_messages(args, cfg.vocab_size)
    plain, plain_replies = run_arm(decoder, False, args, system, users)
    cache, cache_replies = run_arm(decoder, True, args, system, users)
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name(device) if cuda else "cpu",
               layers=cfg.n_layers, same_replies=plain_replies == cache_replies,
               prefill_tokens_saved=1 - cache["prefill_tokens_computed"] / plain["prefill_tokens_computed"],
               ttft_median_ratio=cache["ttft_median_ms"] / plain["ttft_median_ms"])
    report(dict(env=env, arms=[plain, cache]), args.out)
    leave()


if __name__ == "__main__":
    main()
