"""The speculative loop's cost against its captured graphs: greedy and sampled, per batch.

    python3 benchmarks/bench_spec_loop.py --out $OUT/spec_loop.json            # one GPU, 8B-shaped target
    python3 benchmarks/bench_spec_loop.py --small --device cpu                  # the script itself, on CPU

One GPU (a group of one), ``SpecDecoder(cuda_graphs=True)``, a Llama-3-8B-shaped target
(32 layers, vocabulary 128,256, random weights, bf16) with an EAGLE3 draft (draft
vocabulary 32,768), k=3, 64-token prompts.  Per batch size and temperature:

- **loop**: seconds per verify step of the whole ``generate()`` loop, from two runs of
  different lengths (their difference removes the prefill), medians of ``--reps``;
- **graphs**: the captured graphs alone, replayed back to back with CUDA events: verify +
  commit + draft extend + ``k - 1`` draft steps, the graphs one step replays;
- **ratio** loop / graphs: what the host adds (sampling, acceptance, bookkeeping, the
  one device-to-host copy of the step's tokens).

Random weights accept almost nothing, so every step emits one token per row: the step
count is the token count, the same for every temperature, and the step's work does not
depend on the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import dcp_compile as dcp
from dcp_compile.models import DraftConfig, EagleDraft, Llama, LlamaConfig
from dcp_compile.models.llama import llama3_8b_shape
from _report import leave, log, median_ms, parse_with_watchdog, randomize, report

SMALL = LlamaConfig(vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=128,
                    aux_layers=(1, 2, 3))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_times(decoder, k: int, reps: int) -> dict:
    """Median milliseconds of each captured graph's replay, and one step's sum (a group
    of size 1 verifies in place: no commit graph, 0 ms)."""
    verify, commit, draft = decoder.graphs.target_verify, decoder.graphs.commit_c, decoder.graphs.draft_step
    times = {}

    def replay_ms(graph) -> float:
        return median_ms(graph.replay, reps)

    (times["verify"],) = [replay_ms(c.graph) for c in verify.graphs.values()]
    (times["commit"],) = [replay_ms(c.graph) for c in commit.graphs.values()] if commit is not None else [0.0]
    for signature, captured in draft.graphs.items():
        tokens = signature[0][0][1]
        times["draft_extend" if tokens > 1 else "draft_step"] = replay_ms(captured.graph)
    times["step_sum"] = times["verify"] + times["commit"] + times["draft_extend"] + (k - 1) * times["draft_step"]
    return times


def loop_seconds_per_step(decoder, prompts, short: int, long: int, reps: int, device) -> tuple[float, int]:
    def run(new: int) -> tuple[float, int]:
        sync(device)
        start = time.perf_counter()
        dcp.generate_all(decoder, prompts, new)
        sync(device)
        return time.perf_counter() - start, decoder.device_step.verify_steps

    run(short)  # compiles and captures
    shorts, longs = [], []
    for _ in range(reps):
        shorts.append(run(short))
        longs.append(run(long))
    steps = longs[0][1] - shorts[0][1]
    per_step = (statistics.median(t for t, _ in longs) - statistics.median(t for t, _ in shorts)) / steps
    return per_step, steps


def measure(batch: int, args, device) -> dict:
    base = SMALL if args.small else llama3_8b_shape()
    max_seq_len = args.prompt_len + args.new + 2 * (args.k + 1)
    cfg = dataclasses.replace(base, max_batch=batch, max_seq_len=max_seq_len)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    target = randomize(Llama(cfg, dtype=dtype, device=device, cache_device="meta")).eval()
    dcfg = DraftConfig(cfg, "eagle3", draft_vocab_size=min(32768, cfg.vocab_size))
    draft = randomize(EagleDraft(dcfg, dtype=dtype, device=device, cache_device="meta")).eval()
    single = dcp.DCPGroup(1, 0, device, None)
    graphs = device.type == "cuda"
    log(f"batch {batch}: building the decoder (compiles on first use)")
    decoder = dcp.SpecDecoder(target, draft, single, k=args.k, max_batch=batch, max_seq_len=max_seq_len,
                              cuda_graphs=graphs, lowering="inductor" if graphs else "aot_eager")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
    point = dict(batch=batch, k=args.k, prompt_len=args.prompt_len, vocab=cfg.vocab_size, layers=cfg.n_layers)
    for temperature in args.temperatures:
        decoder.temperature = temperature
        per_step, steps = loop_seconds_per_step(decoder, prompts, args.new // 4, args.new, args.reps, device)
        point[f"loop_ms_t{temperature}"] = per_step * 1e3
        point[f"steps_t{temperature}"] = steps
        log(f"batch {batch} temperature {temperature}: loop {per_step * 1e3:.2f} ms per step ({steps} steps)")
    if graphs:
        point["graphs_ms"] = graph_times(decoder, args.k, args.graph_reps)
        total = point["graphs_ms"]["step_sum"]
        for temperature in args.temperatures:
            point[f"ratio_t{temperature}"] = point[f"loop_ms_t{temperature}"] / total
        log(f"batch {batch}: graphs {point['graphs_ms']}")
    return point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=64, help="new tokens of the long run (the short one: a quarter)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--graph-reps", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a 4-layer model (to check the script)")
    parser.add_argument("--out")
    args = parse_with_watchdog(parser)
    device = torch.device(args.device)
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    points = []
    for batch in args.batches:
        points.append(measure(batch, args, device))
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report(dict(env=env, points=points), args.out)
    leave()


if __name__ == "__main__":
    main()
