"""Transformers' ``generate()`` after ``compile_for_generate`` against transformers' own
``generate()`` with its compiled static cache, side by side in one process: long
left-padded prompts at batch 4, masked and unmasked.

    python3 benchmarks/gpu_hf_generate_speed.py --layers 4       # one H200: Llama-3-8B widths, 4 layers
    python3 benchmarks/gpu_hf_generate_speed.py --layers 32      # the full 32-layer shape
    python3 benchmarks/gpu_hf_generate_speed.py --small          # tiny model on CPU: the same code path

The model runs as a group of one with the cascade (the prefix and window Triton kernels
and the merge every rank of a DCP group runs, without the collective).  Arms, on the
same model, prompts and ``StaticCache`` capacity:
- ``dcp``: ``generate()`` after ``compile_for_generate`` (one prefill-chunk graph and one
  decode graph, Inductor);
- ``transformers``: ``generate()`` with a ``StaticCache`` passed in, which transformers
  compiles itself (its decode forward, ``mode="reduce-overhead"``: CUDA graphs); the
  prefill runs eager.

For every prompt width, two batches: ``padded`` (row 0 fills the width, the others are
shorter and left-padded) and ``full`` (no padding).  Each is generated with
``--new-tokens`` and with ``--short-new-tokens`` new tokens, ``--reps`` times; the
decode step is the difference of the two medians over the difference of the lengths,
so the prefill cancels.  Reported per arm, width and batch: the median seconds of a
whole call, the decode step in ms; the masked decode step over the unmasked one;
``dcp`` over ``transformers``; Dynamo's graph count after the warm-up and at the end
(no growth: a new width compiles nothing), and the seconds of the first call of each
new width; and how close the first step's logits are to transformers' eager ones (the
compiled transformers arm's distance beside ours, as the yardstick for bf16 rounding).

The last line is the JSON report.  The script leaves with ``os._exit`` once it has
printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from dcp_compile.group import DCPGroup
from dcp_compile.hf import cache_kwarg, compile_for_generate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import leave  # noqa: E402
from gpu_hf import build_model  # noqa: E402


def batch_of(width: int, batch: int, vocab: int, padded: bool, seed: int):
    """``(ids, mask)``: ``batch`` rows of ``width``, rows after the first left-padded when ``padded``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, width), generator=gen)
    mask = torch.ones(batch, width, dtype=torch.long)
    if padded:
        for row in range(1, batch):
            pad = width * row // (batch + 1)
            ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def timed(generate, ids, mask, new_tokens: int, device) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = generate(ids.to(device), mask.to(device), new_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def measure(generate, widths, args, vocab, device, graphs) -> dict:
    """Medians per width and batch kind; the first call of each width timed alone."""
    rows = {}
    for width in widths:
        for kind in ("padded", "full"):
            ids, mask = batch_of(width, args.batch, vocab, kind == "padded", seed=width)
            first, _ = timed(generate, ids, mask, args.short_new_tokens, device)
            runs = {n: [timed(generate, ids, mask, n, device)[0] for _ in range(args.reps)]
                    for n in (args.new_tokens, args.short_new_tokens)}
            long_s, short_s = (statistics.median(runs[n]) for n in (args.new_tokens, args.short_new_tokens))
            rows[f"{width}/{kind}"] = dict(
                first_call_s=round(first, 4), call_s=round(long_s, 4), short_call_s=round(short_s, 4),
                decode_step_ms=round(1e3 * (long_s - short_s) / (args.new_tokens - args.short_new_tokens), 3),
                graphs=graphs())
            print(f"  {width}/{kind}: {rows[f'{width}/{kind}']}", flush=True)
    return rows


def first_step_logits(generate_scores, ids, mask, device) -> torch.Tensor:
    with torch.no_grad():
        out = generate_scores(ids.to(device), mask.to(device))
    return out.scores[0].float()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="tiny model on CPU (fp32, aot_eager): the same code path")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--widths", default="2048,16384")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--short-new-tokens", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    if args.small:
        args.widths, args.new_tokens, args.short_new_tokens, args.chunk_size, args.reps = "40,90", 6, 2, 16, 1
    widths = [int(w) for w in args.widths.split(",")]
    device = torch.device("cpu") if args.small else torch.device("cuda", 0)
    group = DCPGroup(1, 0, device, None)
    dtype = torch.float32 if args.small else getattr(torch, args.dtype)
    model = build_model("llama3-8b", args.small, group, dtype, layers=None if args.small else args.layers)
    import transformers
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    capacity = max(widths) + args.new_tokens
    kw = cache_kwarg(model)
    reference_cache = StaticCache(config=model.config, max_cache_len=capacity)
    options = dict(do_sample=False, pad_token_id=0)

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    def transformers_generate(ids, mask, new_tokens, compiled=True, **extra):
        reference_cache.reset()
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, disable_compile=not compiled,
                              **{kw: reference_cache}, **options, **extra)

    probe = batch_of(widths[0], args.batch, model.config.vocab_size, True, seed=1)
    scores = dict(output_scores=True, return_dict_in_generate=True)
    eager_logits = first_step_logits(lambda i, m: transformers_generate(i, m, 2, compiled=False, **scores),
                                     *probe, device)
    report = dict(
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__,
        transformers=transformers.__version__, dtype=str(dtype), layers=model.config.num_hidden_layers,
        batch=args.batch, widths=widths, new_tokens=[args.new_tokens, args.short_new_tokens], reps=args.reps,
        chunk_size=args.chunk_size, capacity=capacity, command=" ".join([os.path.basename(sys.executable), *sys.argv]),
    )
    def arm(name: str, generate) -> torch.Tensor:
        """Warm-up, the timed rows and the first-step logits of one arm, into the report."""
        start = time.perf_counter()
        generate(*(t.to(device) for t in probe), 2)
        report[f"{name}_warmup_s"] = round(time.perf_counter() - start, 2)
        graphs_before = graphs()
        report[name] = measure(generate, widths, args, model.config.vocab_size, device, lambda: graphs() - graphs_before)
        return first_step_logits(lambda i, m: generate(i, m, 2, **scores), *probe, device)

    print("transformers' generate() with its compiled static cache ...", flush=True)
    compiled_logits = arm("transformers", transformers_generate)
    print("generate() after compile_for_generate ...", flush=True)
    compile_for_generate(model, group, lowering="aot_eager" if args.small else "inductor", cascade=True,
                         chunk_size=args.chunk_size, max_batch_size=args.batch, max_cache_len=capacity)
    dcp_logits = arm("dcp", lambda ids, mask, new_tokens, **extra: model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, **options, **extra))

    def distance(logits):  # the largest gap over the reference's spread, per row
        return round(float(((logits - eager_logits).abs().amax(-1) / eager_logits.std(-1)).max()), 4)

    report["first_logits_vs_transformers_eager"] = dict(dcp=distance(dcp_logits),
                                                         transformers_compiled=distance(compiled_logits))
    report["argmax_equal_to_eager"] = dict(
        dcp=int((dcp_logits.argmax(-1) == eager_logits.argmax(-1)).sum()),
        transformers_compiled=int((compiled_logits.argmax(-1) == eager_logits.argmax(-1)).sum()), of=args.batch)
    ratios = {}
    for key in report["dcp"]:
        ours, theirs = report["dcp"][key], report["transformers"][key]
        ratios[key] = dict(call=round(ours["call_s"] / theirs["call_s"], 3),
                           decode_step=round(ours["decode_step_ms"] / theirs["decode_step_ms"], 3))
    report["dcp_over_transformers"] = ratios
    report["dcp_masked_over_unmasked_decode_step"] = {
        width: round(report["dcp"][f"{width}/padded"]["decode_step_ms"] / report["dcp"][f"{width}/full"]["decode_step_ms"], 3)
        for width in widths}
    for key, ratio in ratios.items():
        print(f"{key}: dcp {report['dcp'][key]['call_s']} s ({report['dcp'][key]['decode_step_ms']} ms/step), "
              f"transformers {report['transformers'][key]['call_s']} s "
              f"({report['transformers'][key]['decode_step_ms']} ms/step): {ratio}", flush=True)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    main()
    leave()
