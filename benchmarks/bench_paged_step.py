"""The paged target's decode and verify step against the same step over per-row caches.

    python3 benchmarks/bench_paged_step.py --out $OUT/paged_step.json       # one GPU, 8B-shaped layers
    python3 benchmarks/bench_paged_step.py --small --device cpu             # the script itself, on CPU

One GPU (a group of one), a Llama-3-8B-shaped target (``--layers`` of its 32, random
bf16 weights), batch ``--batch``, every row at ``context`` cached tokens.  Three arms, each
its own model, prepared and compiled with ``dcp.backend`` (Inductor) and replayed as a
CUDA graph:

- **rows**: the caches as ``SpecDecoder`` lays them out on one GPU, without a pool
  (``prepare(verify_tokens=k + 1)``): the verify writes in place, no commit;
- **cascade**: the same rows through the prefix kernels (``backend(cascade=True)``), the
  unpaged form of what the paged arm runs;
- **paged**: ``prepare(page_size=P, kv_tokens=batch x (context + 64))``, every row's pages
  taken from a shuffled pool: the prefix kernels read through the block table, the verify
  stages its tokens and ``KVCommit`` moves them into pages (timed with the verify).

Per context: the decode step (one token a row) and the verify step (``k + 1`` tokens a
row, plus the commit for the paged arm, compiled as ``SpecDecoder`` compiles it, and timed
alone too), medians of ``--reps`` CUDA-event timings of the graph's replay; the paged arm's ratio to each other arm; and whether its logits equal the
cascade arm's (the paged kernels read the same keys in the same order).
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

import dcp_compile as dcp
from dcp_compile.models import LlamaConfig
from dcp_compile.models.llama import llama3_8b_shape
from dcp_compile.runtime.commit import KVCommit
from _report import Timer, leave, log, parse_with_watchdog, random_llama, report

SMALL = LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128)


def fill_caches(model, capacity: int) -> None:
    """The same random keys and values at every (row, position) in every arm, rows or pages:
    a kernel timed over zeros can run faster than over real data."""
    from dcp_compile.records import paged_for, record_for

    gen = torch.Generator(device=model.output.weight.device).manual_seed(7)
    with torch.no_grad():
        for buffer in (b for b in model.buffers() if record_for(b) is not None):
            B, H, _, D = buffer.shape
            values = torch.randn(B, H, capacity, D, generator=gen, device=buffer.device).to(buffer.dtype)
            paged = paged_for(buffer)
            if paged is None:
                buffer[:, :, :capacity] = values
                continue
            P = paged.pool.shape[2]
            by_page = values.unflatten(2, (-1, P)).transpose(1, 2)  # [B, pages a row, H, P, D]
            paged.pool[paged.table.long()] = by_page
            del values, by_page


def build(cfg: LlamaConfig, arm: str, args, context: int, device) -> dict:
    """One arm's model, compiled decode and verify calls, and its commit."""
    import dataclasses

    max_seq_len = context + 64  # the verify window and the draft's slack past the longest row
    cfg = dataclasses.replace(cfg, max_batch=args.batch, max_seq_len=max_seq_len)
    model = random_llama(cfg, device)
    group = dcp.init_group(device.type)
    verify = args.k + 1
    paging = dict(page_size=args.page_size, kv_tokens=args.batch * max_seq_len) if arm == "paged" else {}
    prepared = dcp.prepare(model, group, "target", max_batch=args.batch, max_seq_len=max_seq_len,
                           verify_tokens=verify, **paging)
    if prepared.paging is not None:
        table = prepared.paging.table
        order = torch.randperm(prepared.paging.shape.pages, generator=torch.Generator().manual_seed(1))
        table.copy_(order[: table.numel()].view(table.shape).to(table.dtype))
    fill_caches(model, max_seq_len)
    lowering = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = {}
    for name, width in (("decode", 1), ("verify", verify)):
        backend = dcp.backend(group, "target", lowering=lowering, verify=name == "verify", check_positions=False,
                              cascade=arm == "cascade")
        compiled[name] = (torch.compile(model, backend=backend, fullgraph=True, dynamic=False), width)
    commit = KVCommit(model)
    # As SpecGraphs runs it: compiled with the step's lowering, so its copies fuse.
    commit_c = torch.compile(commit, backend=lowering, fullgraph=True, dynamic=False) if commit.needed else None
    return dict(compiled=compiled, commit=commit_c, model=model)


def step_calls(built: dict, name: str, context: int, device):
    fn, width = built["compiled"][name]
    batch = built["model"].cfg.max_batch
    tokens = torch.randint(0, 500, (batch, width), device=device)
    positions = (context + torch.arange(width, device=device)).expand(batch, width).contiguous()
    start = torch.full((batch,), context, device=device, dtype=torch.long)
    accepted = torch.full((batch,), width, device=device, dtype=torch.long)
    out = {}

    def call():
        out["logits"] = fn(tokens, positions)
        if name == "verify" and built["commit"] is not None:
            built["commit"](start, accepted)

    return call, out


def measure_arm(cfg, arm: str, args, device, points: dict, logits: dict) -> None:
    timer = Timer(device, args.reps, warmup=3)
    built = build(cfg, arm, args, max(args.contexts), device)
    with torch.no_grad():
        for context in args.contexts:
            for name in ("decode", "verify"):
                call, out = step_calls(built, name, context, device)
                run, method = timer.prepare([call])
                points[context][f"{arm}_{name}_ms"] = timer.measure(run, 1) * 1e3
                points[context]["method"] = method
                logits[(arm, context, name)] = out["logits"].clone()
            if built["commit"] is not None:  # the verify's share that is the commit alone
                start = torch.full((args.batch,), context, device=device, dtype=torch.long)
                accepted = torch.full((args.batch,), args.k + 1, device=device, dtype=torch.long)
                run, _ = timer.prepare([lambda: built["commit"](start, accepted)])
                points[context][f"{arm}_commit_ms"] = timer.measure(run, 1) * 1e3
            log(f"{arm} at {context}: " + json.dumps({k: v for k, v in points[context].items() if k.startswith(arm)}))


def measure(cfg, args, device) -> list[dict]:
    """Every context of every arm, each arm built once for the longest context (its
    rows at ``context`` tokens is a position, not a shape: no recompile)."""
    points = {c: dict(context=c, batch=args.batch, page_size=args.page_size) for c in args.contexts}
    logits = {}
    for arm in args.arms:
        log(f"{arm}: compiling")
        measure_arm(cfg, arm, args, device, points, logits)
        # The arm's model, caches, compiled code and captured graphs go before the next one's.
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            log(f"after {arm}: {torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB free")
    for context, point in points.items():
        for name in ("decode", "verify"):
            for other in ("rows", "cascade"):
                if other in args.arms and "paged" in args.arms:
                    point[f"paged_over_{other}_{name}"] = point[f"paged_{name}_ms"] / point[f"{other}_{name}_ms"]
            if {"paged", "cascade"} <= set(args.arms):
                point[f"paged_equals_cascade_{name}"] = bool(torch.equal(logits[("paged", context, name)],
                                                                         logits[("cascade", context, name)]))
    return list(points.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 8B shape's 32 (default 4)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--arms", nargs="+", choices=("rows", "cascade", "paged"), default=["rows", "cascade", "paged"])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a 2-layer toy (to check the script)")
    parser.add_argument("--out")
    args = parse_with_watchdog(parser)
    device = torch.device(args.device)
    import dataclasses

    cfg = SMALL if args.small else dataclasses.replace(llama3_8b_shape(aux_layers=()), n_layers=args.layers)
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               layers=cfg.n_layers)
    points = measure(cfg, args, device)
    for point in points:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items()))
    report(dict(env=env, points=points), args.out)
    leave()


if __name__ == "__main__":
    main()
