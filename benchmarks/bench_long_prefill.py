"""Long prompts under DCP: chunked prefill speed and accuracy against one GPU's flash
SDPA, and a real 8 x 128K prefill followed by EAGLE3 speculative decoding.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout -k 10 560 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_long_prefill.py \
        --phase speed --out $OUT/prefill_speed.json
    timeout -k 10 580 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_long_prefill.py \
        --phase long --out $OUT/prefill_long.json
    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_long_prefill.py --small  # CPU: checks the script

``--phase speed``: Llama-3-8B-shaped layers (``--layers``, random weights, bf16), at
prompts one GPU can hold (``--points`` B:T).  The DCP=N arm prefills through the sharded
target in ``[B, chunk]`` chunks (every ``--chunk-sizes``), logits at the last position
only.  The one-GPU arm is the same model run over the whole prompt at once with
PyTorch's fused causal SDPA (``is_causal=True``, the flash backend), writing no cache,
compiled by plain ``torch.compile``; it runs on every GPU side by side, and rank 0's
time is reported.  Both arms' last-position logits are compared with an fp32 run of the
same weights: the DCP arm passes the bf16 policy of BENCHMARKS.md if its max and mean
distance from fp32 are at most twice the flash arm's.

``--phase long``: the full 32-layer model and an EAGLE3 draft in ``SpecDecoder``
(k=3, CUDA graphs), a batch of 8 prompts of 131,072 tokens each (random token ids, a
real prefill: every K/V in the cache comes from the prompt), then ``--new-tokens``
tokens of speculative decoding.  The memory plan for one GPU is checked first (it must
refuse).  Reports the prefill time and tokens/s, the decode step time, and each rank's
peak memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

import dcp_compile as dcp
from dcp_compile.models import DraftConfig, EagleDraft, Llama, eagle3_aux_layers
from dcp_compile.models.llama import take_rows
from dcp_compile.runtime.generate import prefill_chunks
from bench_e2e import dtype_for, log, lowering_for, randomize, target_config
from _report import leave, parse_with_watchdog, report


def flash_prefill(model: Llama, tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The whole prompt in one pass with fused causal SDPA (no cache): logits ``[B, V]``
    at each row's ``last`` index."""
    T = tokens.shape[1]
    x = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos[None, :T], model.rope_sin[None, :T]
    for layer in model.layers:
        x = layer.forward_uncached(x, cos, sin)
    return model.output(take_rows(model.norm(x), last[:, None])).float()[:, 0]


def reference_prefill(model: Llama, tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``flash_prefill`` for an fp32 model: K/V heads repeated for the query heads, since
    SDPA's fp32 (memory-efficient) kernel takes no ``enable_gqa`` and the math fallback
    would hold ``T x T`` scores."""
    T = tokens.shape[1]
    x = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos[None, :T], model.rope_sin[None, :T]
    for layer in model.layers:
        attention, h = layer.attention, layer.attention_norm(x)
        q, k, v = (t.transpose(1, 2) for t in attention.project(h, cos, sin))
        group = q.shape[1] // k.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True)
        x = x + attention.wo(out.transpose(1, 2).reshape(*x.shape[:2], -1))
        x = x + layer.feed_forward(layer.ffn_norm(x))
    return model.output(take_rows(model.norm(x), last[:, None])).float()[:, 0]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int, group=None) -> tuple[float, object]:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up, and its last result."""
    out = fn()
    samples = []
    for _ in range(reps):
        if group is not None and group.size > 1:
            dist.barrier(group.process_group)
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), out


def distance(a: torch.Tensor, b: torch.Tensor) -> dict:
    diff = (a.double() - b.double()).abs()
    return dict(max=float(diff.max()), mean=float(diff.mean()))


def speed_phase(args, group, device) -> dict | None:
    base, _ = target_config(args.small, layers=args.layers)
    rows = []
    for point in args.points.split(","):
        batch, length = (int(x) for x in point.split(":"))
        if args.small:
            batch, length = min(batch, 2), min(length, 96)
        cfg = dataclasses.replace(base, max_batch=batch, max_seq_len=length + 64)
        gen = torch.Generator().manual_seed(args.seed + batch)
        prompts = torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)
        tokens = prompts.to(device)
        last = torch.full((batch,), length - 1, device=device)

        torch.manual_seed(args.seed)
        plain = randomize(Llama(cfg, dtype=dtype_for(device), device=device, cache_device="meta")).eval()
        state = {k: v.detach().clone() for k, v in plain.state_dict().items()}
        flash = torch.compile(flash_prefill, fullgraph=True, dynamic=False) if device.type == "cuda" else flash_prefill
        with torch.no_grad():
            flash_s, flash_logits = timed(lambda: flash(plain, tokens, last), device, args.reps)
            reference = plain.float()
            ref_logits = reference_prefill(reference, tokens, last)
        del plain, reference
        torch._dynamo.reset()
        log(group.rank, f"B={batch} T={length}: one-GPU flash prefill {flash_s:.3f} s")

        model = Llama(cfg, dtype=dtype_for(device), device=device, cache_device="meta").eval()
        model.load_state_dict(state, strict=False)
        dcp.prepare(model, group, "target", max_batch=batch, max_seq_len=cfg.max_seq_len)
        compiled = torch.compile(model, backend=dcp.backend(group, "target", lowering=lowering_for(device)),
                                 fullgraph=True, dynamic=False)
        for chunk_size in (int(c) for c in args.chunk_sizes.split(",")):
            chunk_size = min(chunk_size, cfg.max_seq_len)
            chunks = list(prefill_chunks(prompts.tolist(), chunk_size, cfg.max_seq_len, device))

            def prefill():
                logits = None
                for chunk in chunks:
                    logits = compiled(chunk.tokens, chunk.positions, chunk.last[:, None])
                return logits[:, 0]

            with torch.no_grad():
                dcp_s, dcp_logits = timed(prefill, device, args.reps, group)
            row = dict(batch=batch, prompt=length, chunk=chunk_size, layers=cfg.n_layers, dcp_size=group.size,
                       dcp_s=dcp_s, flash_s=flash_s, ratio=dcp_s / flash_s,
                       dcp_tokens_per_s=batch * length / dcp_s, flash_tokens_per_s=batch * length / flash_s,
                       dcp_vs_fp32=distance(dcp_logits, ref_logits), flash_vs_fp32=distance(flash_logits, ref_logits),
                       dcp_vs_flash=distance(dcp_logits, flash_logits))
            row["bf16_policy_met"] = (row["dcp_vs_fp32"]["max"] <= 2 * row["flash_vs_fp32"]["max"]
                                      and row["dcp_vs_fp32"]["mean"] <= 2 * row["flash_vs_fp32"]["mean"])
            rows.append(row)
            log(group.rank, f"B={batch} T={length} chunk {chunk_size}: DCP={group.size} {dcp_s:.3f} s, ratio to "
                            f"flash {dcp_s / flash_s:.3f}; |DCP - fp32| max {row['dcp_vs_fp32']['max']:.4f} mean "
                            f"{row['dcp_vs_fp32']['mean']:.5f}, |flash - fp32| max {row['flash_vs_fp32']['max']:.4f} "
                            f"mean {row['flash_vs_fp32']['mean']:.5f}")
        del model, compiled, state
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if group.rank != 0:
        return None
    print("\n| B x T | chunk | layers | DCP=N s | one-GPU flash s | ratio | target <= 1.15 | bf16 policy |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} x {r['prompt']} | {r['chunk']} | {r['layers']} | {r['dcp_s']:.3f} | {r['flash_s']:.3f} | "
              f"{r['ratio']:.3f} | {'met' if r['ratio'] <= 1.15 else 'missed'} | "
              f"{'met' if r['bf16_policy_met'] else 'missed'} |")
    return dict(rows=rows)


def long_phase(args, group, device) -> dict | None:
    batch, length, k = args.batch, args.prompt_len, 3
    if args.small:
        batch, length = 2, 200
    base, _ = target_config(args.small, layers=args.layers if args.small else 32)
    max_seq_len = length + args.new_tokens + k + 64
    cfg = dataclasses.replace(base, max_batch=batch, max_seq_len=max_seq_len,
                              aux_layers=eagle3_aux_layers(base.n_layers))
    dcfg = DraftConfig(cfg, "eagle3", draft_vocab_size=min(32768, cfg.vocab_size))
    summary = dict(batch=batch, prompt=length, k=k, chunk=args.chunk_size, dcp_size=group.size, layers=cfg.n_layers)
    if device.type == "cuda":
        planner = dcp.MemoryPlanner(cfg, dcp.device_budget(device), draft=dcfg, verify_tokens=k + 1)
        try:
            planner.check(1, batch, max_seq_len)
            summary["one_gpu_plan"] = "fits"
        except dcp.CapacityError as error:
            summary["one_gpu_plan"] = f"refused: {error}"
        planner.check(group.size, batch, max_seq_len)
        log(group.rank, f"one GPU: {summary['one_gpu_plan'][:300]}")
    torch.manual_seed(args.seed)
    dtype = dtype_for(device)
    target = randomize(Llama(cfg, dtype=dtype, device=device, cache_device="meta")).eval()
    draft = randomize(EagleDraft(dcfg, dtype=dtype, device=device, cache_device="meta")).eval()
    chunk_size = min(args.chunk_size, max_seq_len)
    decoder = dcp.SpecDecoder(target, draft, group, k=k, max_batch=batch, max_seq_len=max_seq_len,
                              lowering=lowering_for(device), cuda_graphs=device.type == "cuda", chunk_size=chunk_size)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    dcp.generate_all(decoder, [torch.randint(0, cfg.vocab_size, (37,), generator=gen).tolist()] * batch, 8)
    summary["compile_s"] = time.perf_counter() - start
    log(group.rank, f"compiled and captured in {summary['compile_s']:.1f} s")
    prompts = [torch.randint(0, cfg.vocab_size, (length,), generator=gen).tolist() for _ in range(batch)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    marks = []

    def first_tokens(request: int, new: list[int]) -> None:
        if not marks:
            marks.append(time.perf_counter())  # emit has synced: the prefill is done

    sync(device)
    start = time.perf_counter()
    outputs = dcp.generate_all(decoder, prompts, args.new_tokens, on_tokens=first_tokens)
    sync(device)
    end = time.perf_counter()
    steps = max(len(o.accepted) for o in outputs)
    tokens = sum(len(o.tokens) for o in outputs)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    peaks = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(group.size)]
    if group.size > 1:
        dist.all_gather(peaks, torch.tensor([float(peak)], dtype=torch.float64, device=device), group=group.process_group)
    else:
        peaks = [torch.tensor([float(peak)])]
    summary.update(
        prefill_s=marks[0] - start, prefill_tokens_per_s=batch * length / (marks[0] - start),
        decode_s=end - marks[0], verify_steps=steps, new_tokens=tokens,
        decode_step_ms=(end - marks[0]) / max(1, steps) * 1e3,
        decode_tokens_per_s=(tokens - batch) / (end - marks[0]),
        mean_accept_length=sum(a + 1 for o in outputs for a in o.accepted) / max(1, sum(len(o.accepted) for o in outputs)),
        peak_gib_per_rank=[float(p) / 2**30 for p in peaks],
        finished=[o.finished_by for o in outputs],
    )
    log(group.rank, f"prefill {summary['prefill_s']:.1f} s ({summary['prefill_tokens_per_s']:.0f} tokens/s), "
                    f"{steps} verify steps at {summary['decode_step_ms']:.2f} ms, peak GiB per rank "
                    f"{[round(p, 1) for p in summary['peak_gib_per_rank']]}")
    return summary if group.rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("speed", "long"), default="speed")
    parser.add_argument("--small", action="store_true", help="tiny shapes on CPU with gloo")
    parser.add_argument("--points", default="1:32768,8:8192", help="speed: B:T prompts one GPU can hold")
    parser.add_argument("--chunk-sizes", default="2048", help="speed: chunk sizes to time (comma-separated)")
    parser.add_argument("--layers", type=int, default=8, help="speed: target layers (long: always 32)")
    parser.add_argument("--batch", type=int, default=8, help="long: prompts")
    parser.add_argument("--prompt-len", type=int, default=131072, help="long: tokens per prompt")
    parser.add_argument("--chunk-size", type=int, default=2048, help="long: chunk size")
    parser.add_argument("--new-tokens", type=int, default=64, help="long: tokens to decode after the prefill")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parse_with_watchdog(parser)
    if args.small:
        args.layers = 2
    _, device = target_config(args.small)
    group = dcp.init_group(device)
    summary = speed_phase(args, group, device) if args.phase == "speed" else long_phase(args, group, device)
    if summary is not None:
        summary.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       torch=torch.__version__, phase=args.phase)
    report(summary, args.out)
    leave()


if __name__ == "__main__":
    main()
