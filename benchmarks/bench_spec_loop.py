"""The speculative loop's cost against its captured step: greedy and sampled, per batch,
the whole step in one graph against its calls captured one by one.

    python3 benchmarks/bench_spec_loop.py --out $OUT/spec_loop.json            # one GPU, 8B-shaped target
    python3 benchmarks/bench_spec_loop.py --small --device cpu                  # the script itself, on CPU
    python3 benchmarks/bench_spec_loop.py --kernels inline opaque               # and the attention kernels' two forms

One GPU (a group of one), ``SpecDecoder(cuda_graphs=True)``, a Llama-3-8B-shaped target
(32 layers, vocabulary 128,256, random weights, bf16) with an EAGLE3 draft (draft
vocabulary 32,768), k=3, 64-token prompts.  One decoder per batch size serves both arms:

- **one graph** (``step_graph``, the default): every verify step is one CUDA graph replay
  (``runtime.step_graph``);
- **calls**: the same decoder with its step graph set aside, so each step replays the
  per-call graphs (verify, commit, draft extend, ``k - 1`` draft steps) with the
  proposals, acceptance and sampling run uncaptured between them.

Per batch size and temperature (arms interleaved):

- **loop**: milliseconds per verify step of the whole ``generate()`` loop, from two runs of
  different lengths (their difference removes the prefill), medians of ``--reps``;
- **step graph**: the one-graph step's replay alone, CUDA events, median of ``--graph-reps``;
- **graphs**: the per-call graphs alone, replayed back to back: their sum is what a
  step of the calls arm replays;
- **ratios**: loop / step graph (what the host adds to the one-graph step), sampled /
  greedy.

Random weights accept almost nothing, so every step emits one token per row: the step
count is the token count, the same for every temperature, and the step's work does not
depend on the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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


def loop_seconds_per_step(decoder, prompts, short: int, long: int, reps: int, device) -> tuple[float, int, list]:
    """Seconds per verify step, the step count, and the long run's tokens."""
    def run(new: int) -> tuple[float, int, list]:
        sync(device)
        start = time.perf_counter()
        outputs = dcp.generate_all(decoder, prompts, new)
        sync(device)
        return time.perf_counter() - start, decoder.device_step.verify_steps, [o.tokens for o in outputs]

    run(short)  # compiles and captures
    shorts, longs = [], []
    for _ in range(reps):
        shorts.append(run(short))
        longs.append(run(long))
    steps = longs[0][1] - shorts[0][1]
    per_step = (statistics.median(t for t, _, _ in longs) - statistics.median(t for t, _, _ in shorts)) / steps
    return per_step, steps, longs[0][2]


def step_graph_ms(step_graph, sampling: bool, reps: int) -> float:
    """The one-graph step's replay alone (the batch's shared generator, no seeded row)."""
    return median_ms(step_graph.steps[(sampling, False)].graph.replay, reps)


def measure(batch: int, kernels: str, args, device) -> dict:
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
                              cuda_graphs=graphs, step_graph=True, lowering="inductor" if graphs else "aot_eager",
                              kernels=kernels)
    whole = decoder.device_step.step_graph
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
    point = dict(batch=batch, kernels=kernels, k=args.k, prompt_len=args.prompt_len, vocab=cfg.vocab_size, layers=cfg.n_layers)
    for temperature in args.temperatures:
        decoder.temperature = temperature
        tokens = {}
        for arm in ARMS:
            decoder.device_step.step_graph = whole if arm == "one_graph" else None
            per_step, steps, tokens[arm] = loop_seconds_per_step(decoder, prompts, args.new // 4, args.new, args.reps,
                                                                 device)
            point[f"loop_ms_{arm}_t{temperature}"] = per_step * 1e3
            point[f"steps_t{temperature}"] = steps
            log(f"batch {batch} temperature {temperature} {arm}: loop {per_step * 1e3:.3f} ms per step ({steps} steps)")
        # The same decoder, seed and prompts: both arms must emit the same tokens.
        point[f"arms_agree_t{temperature}"] = tokens["one_graph"] == tokens["calls"]
    decoder.device_step.step_graph = whole
    if graphs:
        point["graphs_ms"] = graph_times(decoder, args.k, args.graph_reps)
        for temperature in args.temperatures:
            t = f"t{temperature}"
            point[f"step_graph_ms_{t}"] = step_graph_ms(whole, temperature > 0, args.graph_reps)
            point[f"ratio_loop_to_step_graph_{t}"] = point[f"loop_ms_one_graph_{t}"] / point[f"step_graph_ms_{t}"]
            point[f"ratio_calls_loop_to_graphs_{t}"] = point[f"loop_ms_calls_{t}"] / point["graphs_ms"]["step_sum"]
        log(f"batch {batch}: {point}")
    return point


ARMS = ("one_graph", "calls")


def print_table(points: list[dict], temperatures) -> None:
    print("| batch | kernels | temperature | step graph ms | loop, one graph ms | loop / step graph | loop, calls ms | "
          "calls / one graph | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in points:
        for temperature in temperatures:
            t = f"t{temperature}"
            graph = p.get(f"step_graph_ms_{t}", float("nan"))
            one, calls = p[f"loop_ms_one_graph_{t}"], p[f"loop_ms_calls_{t}"]
            print(f"| {p['batch']} | {p['kernels']} | {temperature} | {graph:.3f} | {one:.3f} | {one / graph:.3f} | {calls:.3f} | "
                  f"{calls / one:.3f} | {p[f'arms_agree_{t}']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--kernels", nargs="+", choices=("inline", "opaque"), default=["inline"],
                        help="the attention kernels under Inductor: a decoder per batch and choice, in turn")
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
        for kernels in args.kernels:
            points.append(measure(batch, kernels, args, device))
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.out:  # each point as it lands: a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(dict(env=env, points=points), f, indent=1)
    print_table(points, args.temperatures)
    report(dict(env=env, points=points), args.out)
    leave()


if __name__ == "__main__":
    main()
