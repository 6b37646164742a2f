"""Transformers' ``generate()`` after ``compile_for_generate``, called as a serving loop
calls it: left-padded batches of many prompt widths, on one model compiled once.

    python3 benchmarks/gpu_hf_generate.py                        # one H200: Llama-3-8B shapes, bf16
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout 900 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/gpu_hf_generate.py   # DCP=2
    python3 benchmarks/gpu_hf_generate.py --small                # tiny model on CPU: the same code path

On one GPU the model runs as a group of one with the cascade (``cascade=True``): the
prefix and window Triton kernels and the merge that every rank of a DCP group runs,
without the collective; under ``torch.distributed.run`` it runs sharded over the ranks.
Every call has ``--batch`` rows, row 0 filling the width and the others shorter, padded
on the left; the widths are ``--widths`` different ones, shuffled.

Reported, for the DCP arm and for transformers' own ``generate()`` with its ``StaticCache``
(eager, ``disable_compile=True``) on the same model and prompts:
- the first call's seconds (the DCP arm compiles its prefill-chunk and decode graphs
  there), the median and the largest of the later calls' seconds (a compile for a new
  width would show in the largest), and new tokens per second at the median;
- Dynamo's graph count after the first call and at the end (2 and 2: no recompiles);
- the attention ops in the compiled graphs (``prefix``/``window`` with the left-padding
  bound, ``masked reference`` for a site that fell back) and whether Inductor's code
  holds the Triton kernels (``_flash_fwd_kernel``, ``_prefix_split_kernel``);
- how many calls gave transformers' tokens exactly, and per row how many new tokens
  agree before the first that differs (bf16: the arms differ in rounding, and a
  random-init model's logits are nearly flat, so a near-tie flips a token early; with
  ``--dtype float32`` the arms agree far longer; fp32 on CPU with ``--small``: exactly).

The last line is the JSON report.  The script leaves with ``os._exit`` once it has
printed: NCCL teardown at exit has hung on these machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import dcp_compile as dcp
from dcp_compile.group import DCPGroup
from dcp_compile.hf import cache_kwarg, compile_for_generate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_hf import build_model  # noqa: E402


def prompts(n: int, width_range: tuple[int, int], batch: int, vocab: int, seed: int = 0):
    """``n`` left-padded batches ``(ids, mask)`` of ``n`` different widths in ``width_range``."""
    gen = torch.Generator().manual_seed(seed)
    low, high = width_range
    widths = (torch.randperm(high - low + 1, generator=gen)[:n] + low).tolist()
    out = []
    for width in widths:
        ids = torch.randint(1, vocab, (batch, width), generator=gen)
        mask = torch.ones(batch, width, dtype=torch.long)
        for row in range(1, batch):
            keep = int(torch.randint(1, width + 1, (1,), generator=gen))
            ids[row, : width - keep], mask[row, : width - keep] = 0, 0
        out.append((ids, mask))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_arm(generate, batches, device, new_tokens: int) -> dict:
    """Seconds per call and the tokens of every call."""
    seconds, tokens = [], []
    for ids, mask in batches:
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = generate(ids.to(device), mask.to(device))
        sync(device)
        seconds.append(time.perf_counter() - start)
        tokens.append(out.cpu())
    later = seconds[1:] or seconds
    median = statistics.median(later)
    return dict(first_s=round(seconds[0], 3), median_s=round(median, 4), max_later_s=round(max(later), 4),
                new_tokens_per_s=round(len(batches[0][0]) * new_tokens / median, 1),
                seconds=[round(s, 4) for s in seconds],
                tokens=tokens)


def attention_ops(backend) -> list[dict]:
    from dcp_compile.ops.attention import attention_with_lse
    from dcp_compile.passes.shard_attention import PREFIX_ATTENTION, WINDOW_ATTENTION

    names = {PREFIX_ATTENTION: "prefix", WINDOW_ATTENTION: "window", attention_with_lse: "masked reference"}
    rows = []
    for compiled in backend.compiled:
        counts: dict = {}
        for node in compiled.graph_module.graph.nodes:
            if node.op == "call_function" and node.target in names:
                counts[names[node.target]] = counts.get(names[node.target], 0) + 1
        rows.append(counts)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="tiny model on CPU (fp32, aot_eager): the same code path")
    parser.add_argument("--family", default="llama3-8b", choices=["llama3-8b", "deepseek-v2-lite"])
    parser.add_argument("--widths", type=int, default=12, help="calls, each of another prompt width")
    parser.add_argument("--min-width", type=int, default=16)
    parser.add_argument("--max-width", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--max-cache-len", type=int, default=2048)
    parser.add_argument("--lowering", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    if args.small:
        args.min_width, args.max_width, args.new_tokens, args.chunk_size, args.max_cache_len = 1, 50, 6, 16, 64
        args.lowering = "aot_eager"
    if "WORLD_SIZE" in os.environ:
        group = dcp.init_group("cpu" if args.small else None)
    else:
        group = DCPGroup(1, 0, torch.device("cpu") if args.small else torch.device("cuda", 0), None)
    say = print if group.rank == 0 else (lambda *a, **k: None)
    dtype = torch.float32 if args.small else getattr(torch, args.dtype)
    model = build_model(args.family, args.small, group, dtype)
    import transformers
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    batches = prompts(args.widths, (args.min_width, args.max_width), args.batch, model.config.vocab_size)
    options = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    report = dict(
        dcp_size=group.size, gpu=torch.cuda.get_device_name(group.device) if group.device.type == "cuda" else "cpu",
        torch=torch.__version__, transformers=transformers.__version__, lowering=args.lowering, dtype=str(dtype),
        family=args.family, batch=args.batch, widths=[int(ids.shape[1]) for ids, _ in batches],
        new_tokens=args.new_tokens, chunk_size=args.chunk_size, max_cache_len=args.max_cache_len,
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
    )

    kw = cache_kwarg(model)
    reference_cache = StaticCache(config=model.config, max_cache_len=args.max_cache_len)

    def hf_generate(ids, mask):
        reference_cache.reset()
        return model.generate(ids, attention_mask=mask, disable_compile=True, **{kw: reference_cache}, **options)

    say("transformers' generate() ...", flush=True)
    hf = run_arm(hf_generate, batches, group.device, args.new_tokens)

    backend = compile_for_generate(model, group, lowering=args.lowering, cascade=group.size == 1,
                                   chunk_size=args.chunk_size, max_batch_size=args.batch,
                                   max_cache_len=args.max_cache_len)
    graphs_after_first = []
    kernels_in_code = {}

    def dcp_generate(ids, mask):
        if graphs_after_first or args.lowering != "inductor":
            out = model.generate(ids, attention_mask=mask, **options)
        else:
            from torch._inductor.utils import run_and_get_code

            out, code = run_and_get_code(lambda: model.generate(ids, attention_mask=mask, **options))
            code = "\n".join(code)
            kernels_in_code.update({k: k in code for k in ("_flash_fwd_kernel", "_prefix_split_kernel")})
        if not graphs_after_first:
            graphs_after_first.append(counters["stats"]["unique_graphs"])
        return out

    say("generate() after compile_for_generate ...", flush=True)
    ours = run_arm(dcp_generate, batches, group.device, args.new_tokens)
    ours_tokens, hf_tokens = ours.pop("tokens"), hf.pop("tokens")
    same = [torch.equal(a, b) for a, b in zip(ours_tokens, hf_tokens)]
    agreeing = []  # per row: new tokens equal to transformers' before the first that differs
    for (ids, _), a, b in zip(batches, ours_tokens, hf_tokens):
        differs = (a[:, ids.shape[1]:] != b[:, ids.shape[1]:]).int()
        agreeing += torch.where(differs.any(1), differs.argmax(1), differs.shape[1]).tolist()
    report.update(
        dcp_arm=ours, transformers_arm=hf, warm_ratio=round(ours["median_s"] / hf["median_s"], 3),
        graphs_after_first_call=graphs_after_first[0], graphs=counters["stats"]["unique_graphs"],
        attention_ops=attention_ops(backend), triton_kernels_in_inductor_code=kernels_in_code,
        calls_with_transformers_tokens=f"{sum(same)}/{len(same)}",
        new_tokens_agreeing_per_row=agreeing,
    )
    say(f"DCP arm: first call {ours['first_s']} s, later calls median {ours['median_s']} s "
        f"(max {ours['max_later_s']} s), "
        f"{ours['new_tokens_per_s']} new tokens/s; transformers: first {hf['first_s']} s, median {hf['median_s']} s; "
        f"graphs {graphs_after_first[0]} after the first call, {report['graphs']} at the end; transformers' tokens in "
        f"{report['calls_with_transformers_tokens']} calls", flush=True)
    say(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
