"""End-to-end decode step time of a Llama-3-8B-shaped or a DeepSeek-V2-Lite-shaped (MLA)
target: DCP=N against DCP=1.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout -k 10 580 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_e2e.py --out $OUT/e2e.json
    timeout -k 10 580 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_e2e.py --model v2lite \
        --regional --contexts 32768,65536,131072,262144,524288 --batches 8,32 --verify-batches 8,32 \
        --edge 32:262144 --out $OUT/e2e_mla.json
    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_e2e.py --small   # CPU, gloo: checks the script

Each (batch, T) point costs one 32-layer Inductor compile per arm (about 2.3 minutes on
the H200 machines); ``--regional`` compiles one decoder layer instead, whose graph
every layer then runs (Dynamo reuses it: the layers differ only in their weights and
caches, which are graph inputs), so a point costs one layer's compile.  The step is
then the model's own ``forward`` over the compiled layers, captured whole in one CUDA
graph as before; only the embedding, the final norm and the head run outside
Inductor, alike in both arms.  ``--arms`` and ``--batches`` / ``--verify-batches``
choose what a call measures, and every measured step is logged as it comes
(``plot_regime.py`` reads the log), so a run cut short keeps what it measured.

``--model v2lite``: DeepSeek-V2-Lite's attention (27 layers, hidden 2048, 16 heads,
latent 512 + rope 64, no query low rank) with a dense SwiGLU MLP sized to its about
2.4B active parameters, vocabulary 102400.  Each (batch, T) point measures the contexts
of ``--contexts`` that one GPU's memory plan takes for that batch (the largest that fits
included); ``--edge`` adds a point past the single-GPU edge, measured by DCP=N alone.

Like for like: both arms run the same kernels.  The DCP=N arm is ``dcp.backend(group)``
over N ranks; the DCP=1 arm is ``dcp.backend(group_of_one, cascade=True)`` on rank 0
(the same prefix kernel, window and merge, no collective); both arms and the draft
compile under Inductor's deterministic mode, which DCP groups need (it costs 0.7-1.2% of the step:
BENCHMARKS.md).  One graph per (batch, T)
serves every context, because the context is only the positions' value: the cache is
filled with random K/V and each sequence decodes at position ``context``.

Per point: median of CUDA-event timed replays of one captured step (T=1 decode, T=k+1
verify for EAGLE3 chain k).  ``W`` is the DCP=1 step at context 0 (weights, no KV),
``A`` = DCP=1 step - W (attention over the context), ``C`` = DCP=N step at context 0 -
W (collectives and merges).  Ideal DCP=N / DCP=1 ratio: ``(W + A/N + C) / (W + A)``;
target: measured within 5% of ideal.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import dcp_compile as dcp
from dcp_compile.models import DraftConfig, EagleDraft, Llama, LlamaConfig
from dcp_compile.models.llama import llama3_8b_shape
from dcp_compile.models.mla import MLAConfig, MLATransformer, deepseek_v2_lite_shape
from _report import leave, parse_with_watchdog, randomize, report

CACHE_BUFFERS = ("k_cache", "v_cache", "kv_cache", "pe_cache")


def target_config(small: bool, layers: int | None = None, model: str = "llama8b"):
    """The benchmarks' target config and its device: Llama-3-8B-shaped (32 layers) or
    DeepSeek-V2-Lite-shaped (``model="v2lite"``, 27 layers) on this rank's GPU, or
    (``small``) a tiny model of that kind on CPU that checks the scripts."""
    if model not in ("llama8b", "v2lite"):
        raise SystemExit(f"--model takes llama8b or v2lite, got {model!r}")
    if small:
        if model == "v2lite":
            cfg = MLAConfig(vocab_size=256, dim=64, n_layers=layers or 3, n_heads=4, kv_lora_rank=32,
                            qk_rope_head_dim=16, intermediate_size=128)
        else:
            cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=layers or 2, n_heads=4, n_kv_heads=2,
                              intermediate_size=128)
        return cfg, torch.device("cpu")
    if model == "v2lite":
        cfg = deepseek_v2_lite_shape(n_layers=layers or 27)
    else:
        cfg = dataclasses.replace(llama3_8b_shape(aux_layers=()), n_layers=layers or 32)
    return cfg, torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build(cfg, group, device, seed: int):
    torch.manual_seed(seed)
    dtype = dtype_for(device)
    kind = MLATransformer if isinstance(cfg, MLAConfig) else Llama
    # Caches on meta: prepare allocates only this rank's shard, so a DCP=2 point past the
    # single-GPU edge never holds the whole cache, even for a moment.
    model = randomize(kind(cfg, dtype=dtype, device=device, cache_device="meta")).eval()
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
    with torch.no_grad():
        for layer in model.layers:  # random caches everywhere: timing must not read zeros
            for name in CACHE_BUFFERS:
                cache = getattr(layer.attention, name, None)
                if cache is not None:
                    cache.normal_()
    return model


def replay_timer(call, positions, group, device, reps: int, deterministic: bool | None = True):
    """A function context -> median seconds of ``call()`` with ``positions`` set to
    ``context + arange(T)`` on every row: CUDA-graph replays timed with events on GPU.

    The first call compiles.  ``deterministic`` sets Inductor's deterministic mode for
    that compile (``None``: leave the config alone).  It is on by default so that the
    one-GPU arm and the draft compile the same kernels as a DCP group, which always
    compiles under it (``backend.rank_identical_kernels``)."""
    batch, tokens = positions.shape
    step = torch.arange(tokens, device=device)

    def run():
        with torch.no_grad():
            return call()

    import torch._inductor.config as inductor_config

    mode = contextlib.nullcontext() if deterministic is None else inductor_config.patch(deterministic=deterministic)
    with mode:
        run()
    if device.type == "cuda":
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()

    def timed(context: int) -> float:
        positions.copy_((context + step).expand(batch, tokens))
        samples = []
        for i in range(reps + 3):
            if group.size > 1:
                dist.barrier(group.process_group)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                begin = time.perf_counter()
                run()
                seconds = time.perf_counter() - begin
            if i >= 3:
                samples.append(seconds)
        return statistics.median(samples)

    return timed


def lowering_for(device) -> str:
    return "inductor" if device.type == "cuda" else "aot_eager"


def dtype_for(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def step_timer(model, group, device, batch: int, tokens: int, reps: int, deterministic: bool | None = True,
               regional: bool = False):
    """A function context -> median seconds of one target step of ``tokens`` new tokens per sequence.

    ``regional``: each decoder layer is compiled (one graph, which every layer runs) and
    the step is ``model.forward`` over them; the model's forward pre-hook, which lets a
    sharded model run only through a whole ``dcp.backend`` graph, is passed by calling
    ``forward`` itself: what it guards (every cache read and write) is inside the layers."""
    backend = dcp.backend(group, "target", cascade=group.size == 1, check_positions=False, lowering=lowering_for(device))
    if regional:
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)
        compiled = model.forward
    else:
        compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    token_ids = torch.randint(0, model.cfg.vocab_size, (batch, tokens), device=device)
    positions = torch.zeros(batch, tokens, dtype=torch.long, device=device)
    timed = replay_timer(lambda: compiled(token_ids, positions), positions, group, device, reps, deterministic)
    if regional and len(backend.compiled) != 1:
        raise RuntimeError(f"regional compile: expected one layer graph for every layer, got {len(backend.compiled)}")
    return timed


def measure_draft(cfg: LlamaConfig, device, batch: int, tokens: int, contexts, reps: int, seed: int) -> dict:
    """Per context, the EAGLE3 draft's share of one speculative step of ``k = tokens - 1``
    drafts: one extend over the ``k + 1`` verified positions plus ``k - 1`` chain steps.
    The draft is whole on every rank, so it costs the same in both arms: measured once,
    on a group of one."""
    single = dcp.DCPGroup(1, 0, device, None)
    dcfg = DraftConfig(dataclasses.replace(cfg, max_batch=batch, max_seq_len=max(contexts) + tokens + 64), "eagle3",
                       draft_vocab_size=min(32768, cfg.vocab_size))
    torch.manual_seed(seed)
    dtype = dtype_for(device)
    draft = randomize(EagleDraft(dcfg, dtype=dtype, device=device, cache_device="meta")).eval()
    width = cfg.dim * dcfg.n_features

    def inputs(t: int, features: int):
        return (torch.zeros(batch, t, dtype=torch.long, device=device), torch.zeros(batch, t, dtype=torch.long, device=device),
                torch.randn(batch, t, features, device=device, dtype=dtype))

    dcp.prepare(draft, single, "draft", max_batch=batch, max_seq_len=dcfg.target.max_seq_len,
                example_inputs=inputs(1, cfg.dim))
    with torch.no_grad():
        draft.attention.k_cache.normal_()
        draft.attention.v_cache.normal_()
    # No host position check: it reads the positions on the host, which a CUDA graph capture forbids.
    backend = dcp.backend(single, "draft", check_positions=False, lowering=lowering_for(device))
    compiled = torch.compile(draft, backend=backend, fullgraph=True, dynamic=False)
    timers = {}
    # The extend keeps the logits of one position per row, as SpecDecoder's does.
    last = torch.zeros(batch, 1, dtype=torch.long, device=device)
    for t, features in ((tokens, width), (1, cfg.dim)):
        ids, positions, feats = inputs(t, features)
        extra = (last,) if t > 1 else ()
        timers[t] = replay_timer(
            lambda ids=ids, positions=positions, feats=feats, extra=extra: compiled(ids, positions, feats, *extra),
            positions, single, device, reps)
    times = {}
    for context in contexts:
        extend, step = timers[tokens](context), timers[1](context)
        times[context] = extend + (tokens - 2) * step
        log(0, f"draft batch {batch} k {tokens - 1} context {context}: extend {extend * 1e3:.3f} ms, step "
               f"{step * 1e3:.3f} ms, per speculative step {times[context] * 1e3:.3f} ms")
    del draft, compiled, timers
    torch._dynamo.reset()
    return times


def planner_for(cfg, device, batch: int, tokens: int, contexts) -> tuple:
    """``(config sized for the point, its memory planner)``."""
    pcfg = dataclasses.replace(cfg, max_batch=batch, max_seq_len=max(contexts) + tokens + 64)
    planner = dcp.MemoryPlanner(pcfg, dcp.device_budget(device) if device.type == "cuda" else 1 << 40,
                                verify_tokens=tokens if tokens > 1 else 0)
    return pcfg, planner


def contexts_one_gpu_takes(cfg, device, batch: int, tokens: int, contexts) -> list[int]:
    """The contexts whose cache for ``batch`` sequences one GPU's memory plan takes; the
    smallest alone if none fits (its DCP=1 arm is then refused and reported so)."""
    _, planner = planner_for(cfg, device, batch, tokens, contexts)
    fitting = [c for c in contexts if planner.plan(1, batch, c + tokens + 64).fits]
    return fitting or sorted(contexts)[:1]


def measure_point(cfg, group, device, batch, tokens, contexts, reps, seed, regional=False) -> dict:
    """Step times of one (batch, tokens) graph at every context (and at 0), or
    ``{"refused": why}`` if the memory plan refuses it."""
    pcfg, planner = planner_for(cfg, device, batch, tokens, contexts)
    try:
        planner.check(group.size, batch, pcfg.max_seq_len)
    except dcp.CapacityError as refusal:
        log(group.rank, f"size {group.size} batch {batch} T {tokens}: refused by the plan: {refusal}")
        return dict(refused=str(refusal))
    model = build(pcfg, group, device, seed)
    timed = step_timer(model, group, device, batch, tokens, reps, regional=regional)
    times = {}
    for context in (0, *contexts):
        times[context] = timed(context)
        log(group.rank, f"size {group.size} batch {batch} T {tokens} context {context}: {times[context] * 1e3:.3f} ms")
    del model, timed
    torch._dynamo.reset()
    gc.collect()  # compiled layers and their graphs hold the caches in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def rows_for(n, batch, tokens, contexts, sharded, single, draft=None) -> list[dict]:
    rows = []
    if "refused" in sharded:
        return rows
    if "refused" in single:  # past the single-GPU edge: DCP=N alone, per GPU and per user
        for context in contexts:
            step = sharded[context]
            rows.append(dict(batch=batch, tokens=tokens, context=context, dcp1_ms=None, dcpn_ms=step * 1e3,
                             dcp1_refused=single["refused"], tokens_per_s_per_user=tokens / step,
                             tokens_per_s_per_gpu=batch * tokens / step / n))
        return rows
    W = single[0]
    C = sharded[0] - W
    for context in contexts:
        one, many = single[context], sharded[context]
        A = one - W
        ideal = (W + A / n + C) / (W + A)
        row = dict(batch=batch, tokens=tokens, context=context, dcp1_ms=one * 1e3, dcpn_ms=many * 1e3,
                   W_ms=W * 1e3, A_ms=A * 1e3, C_ms=C * 1e3, ratio=many / one, ideal=ideal,
                   off_ideal=many / one / ideal - 1)
        if tokens == 1:  # a verify step's tokens per second would depend on how many the target accepts
            row.update(tokens_per_s_per_user=dict(dcp1=1 / one, dcpn=1 / many),
                       tokens_per_s_per_gpu=dict(dcp1=batch / one, dcpn=batch / many / n))
        if draft:  # a whole speculative step: verify plus the draft's extend and chain
            D = draft[context]
            spec_ideal = (W + A / n + C + D) / (W + A + D)
            row.update(draft_ms=D * 1e3, spec_dcp1_ms=(one + D) * 1e3, spec_dcpn_ms=(many + D) * 1e3,
                       spec_ratio=(many + D) / (one + D), spec_ideal=spec_ideal,
                       spec_off_ideal=(many + D) / (one + D) / spec_ideal - 1)
        rows.append(row)
    return rows


def print_tables(rows: list[dict], n: int, reps: int, k: int) -> None:
    print(f"\n## decode step, DCP={n} against DCP=1 (same kernels), median of {reps} graph replays")
    print("| batch | T | context | DCP=1 ms | DCP=N ms | ratio | ideal | ratio / ideal - 1 | within 5% |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["dcp1_ms"] is None:
            print(f"| {r['batch']} | {r['tokens']} | {r['context']} | refused | {r['dcpn_ms']:.3f} | - | - | - | "
                  f"per user {r['tokens_per_s_per_user']:.1f} tok/s, per GPU {r['tokens_per_s_per_gpu']:.1f} tok/s |")
            continue
        print(f"| {r['batch']} | {r['tokens']} | {r['context']} | {r['dcp1_ms']:.3f} | {r['dcpn_ms']:.3f} | "
              f"{r['ratio']:.3f} | {r['ideal']:.3f} | {r['off_ideal']:+.1%} | {'met' if abs(r['off_ideal']) <= 0.05 else 'missed'} |")
    spec = [r for r in rows if "spec_ratio" in r]
    if spec:
        print(f"\n## speculative step (EAGLE3 chain k={k}): verify + draft extend + {k - 1} "
              f"draft steps; the draft is whole, the same in both arms")
        print("| batch | context | draft ms | DCP=1 ms | DCP=N ms | ratio | ideal | ratio / ideal - 1 | within 5% |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in spec:
            print(f"| {r['batch']} | {r['context']} | {r['draft_ms']:.3f} | {r['spec_dcp1_ms']:.3f} | "
                  f"{r['spec_dcpn_ms']:.3f} | {r['spec_ratio']:.3f} | {r['spec_ideal']:.3f} | "
                  f"{r['spec_off_ideal']:+.1%} | {'met' if abs(r['spec_off_ideal']) <= 0.05 else 'missed'} |")


def _times(d: dict | None) -> dict | None:
    """JSON turns the context keys into strings; back to ints (``refused`` stays)."""
    if d is None:
        return None
    return {k if k == "refused" else int(k): v for k, v in d.items()}


def combine(summaries: list[dict]) -> tuple[int, list[dict]]:
    """The DCP size and the rows from the measured points of one or more runs (the DCP=N
    arm from one run, the one-GPU arm from others), matched by (batch, T)."""
    sizes = {s["dcp_size"] for s in summaries if s["dcp_size"] > 1}
    if len(sizes) != 1:
        raise SystemExit(f"expected exactly one DCP size > 1 among the runs, found {sorted(sizes) or 'none'}")
    (n,) = sizes
    merged: dict[tuple[int, int], dict] = {}
    for s in summaries:
        for p in s["points"]:
            entry = merged.setdefault((p["batch"], p["tokens"]), dict(contexts=p["contexts"]))
            for arm in ("sharded", "single", "draft"):
                if p.get(arm) is not None:
                    entry[arm] = _times(p[arm])
    rows = []
    for (batch, tokens), e in sorted(merged.items(), key=lambda item: (item[0][1], -item[0][0])):
        if "sharded" in e and "single" in e:
            rows += rows_for(n, batch, tokens, e["contexts"], e["sharded"], e["single"], e.get("draft"))
    return n, rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="tiny shapes on CPU with gloo")
    parser.add_argument("--contexts", default="8192,16384,32768,65536")
    parser.add_argument("--batches", default="8,1")
    parser.add_argument("--verify-k", type=int, default=3, help="EAGLE3 chain k: verify steps carry k+1 tokens")
    parser.add_argument("--verify-widths", default="",
                        help="more verify steps of these token counts (e.g. 32,64: tree verifies), timed without "
                             "the draft at --verify-batches")
    parser.add_argument("--verify-batches", default="8")
    parser.add_argument("--edge", default="8:131072",
                        help="batch:context past one GPU's capacity (DCP=1 refused by the plan); '' to skip")
    parser.add_argument("--arms", default="dcp,one", help="which arms to run: dcp (DCP=N), one (one GPU), or both")
    parser.add_argument("--share", default="0/1",
                        help="I/N: measure only every N-th point from the I-th (one-GPU runs side by side on N GPUs)")
    parser.add_argument("--combine", nargs="+", metavar="JSON",
                        help="no measuring: print the tables from these runs' JSON (a --arms dcp run and --arms one runs)")
    parser.add_argument("--draft-only", action="store_true",
                        help="only the EAGLE3 draft's share of a speculative step, at each --verify-batches batch")
    parser.add_argument("--model", default="llama8b", help="llama8b (Llama-3-8B-shaped) or v2lite (DeepSeek-V2-Lite-shaped MLA)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the model's own, 32 or 27)")
    parser.add_argument("--regional", action="store_true",
                        help="compile one decoder layer, which every layer runs, instead of the whole model")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parse_with_watchdog(parser)
    if args.combine:
        summaries = []
        for path in args.combine:
            with open(path) as f:
                summaries.append(json.load(f))
        n, rows = combine(summaries)
        print_tables(rows, n, summaries[0]["reps"], args.verify_k)
        report(dict(combined=args.combine, runs=summaries, rows=rows), args.out)
        return
    contexts = [48, 96] if args.small else [int(c) for c in args.contexts.split(",")]
    cfg, device = target_config(args.small, args.layers, args.model)
    mla = isinstance(cfg, MLAConfig)
    if args.draft_only and mla:
        raise SystemExit("--draft-only measures the Llama target's EAGLE3 draft; the MLA model's draft is not timed here")
    if args.draft_only:
        draft = {int(b): measure_draft(cfg, device, int(b), args.verify_k + 1, contexts, args.reps, args.seed)
                 for b in args.verify_batches.split(",") if b}
        report(dict(draft=draft, k=args.verify_k, reps=args.reps, torch=torch.__version__,
                    device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"), args.out)
        leave()
    group = dcp.init_group(device)
    single_group = dcp.DCPGroup(1, 0, device, None)
    n = group.size
    points = [(int(b), 1) for b in args.batches.split(",") if b]
    points += [(int(b), args.verify_k + 1) for b in args.verify_batches.split(",") if b]
    wide = [int(t) for t in args.verify_widths.split(",") if t]
    points += [(int(b), t) for t in wide for b in args.verify_batches.split(",") if b]
    points = [(b, t, contexts_one_gpu_takes(cfg, device, b, t, contexts) if mla else contexts) for b, t in points]
    if args.edge and not args.small:
        batch, context = (int(x) for x in args.edge.split(":"))
        points.append((batch, 1, [context]))
    arms = set(args.arms.split(","))
    if not arms <= {"dcp", "one"} or not arms:
        raise SystemExit(f"--arms takes dcp, one or dcp,one; got {args.arms!r}")
    share, shares = (int(x) for x in args.share.split("/"))
    if not 0 <= share < shares:
        raise SystemExit(f"--share takes I/N with 0 <= I < N; got {args.share!r}")
    measured = []
    for index, (batch, tokens, point_contexts) in enumerate(points):
        if index % shares != share:
            continue
        entry = dict(batch=batch, tokens=tokens, contexts=point_contexts)
        if "dcp" in arms:
            entry["sharded"] = measure_point(cfg, group, device, batch, tokens, point_contexts, args.reps, args.seed,
                                             args.regional)
        if group.rank == 0 and "one" in arms:  # the other ranks wait: DCP=1 runs on rank 0's GPU alone
            entry["single"] = measure_point(cfg, single_group, device, batch, tokens, point_contexts, args.reps,
                                            args.seed, args.regional)
            if tokens == args.verify_k + 1 and "refused" not in entry["single"] and not mla:
                entry["draft"] = measure_draft(cfg, device, batch, tokens, point_contexts, args.reps, args.seed)
        measured.append(entry)
        if n > 1:
            dist.barrier(group.process_group)
    if group.rank != 0:
        leave()
    summary = dict(dcp_size=n if "dcp" in arms else 1,
                   device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   torch=torch.__version__, triton=__import__("triton").__version__, model=args.model,
                   layers=cfg.n_layers, regional=args.regional, reps=args.reps, points=measured)
    if arms == {"dcp", "one"} and n > 1:
        _, summary["rows"] = combine([summary])
        print_tables(summary["rows"], n, args.reps, args.verify_k)
    report(summary, args.out)
    leave()


if __name__ == "__main__":
    main()
