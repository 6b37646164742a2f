"""The MLA reference target on one GPU: the latent cascade against eager, and its decode step.

    python3 benchmarks/gpu_mla.py --out $OUT/mla.json
    python3 benchmarks/gpu_mla.py --device cpu --layers 1 --context 256 --steps 2   # the script itself

A DeepSeek-V2-Lite-shaped MLA target (latent 512 + rope 64, 16 heads; ``--layers``
layers, random weights) prepared on a group of one and compiled by ``dcp.backend`` with
``cascade=True`` (the prefix + window + merge cascade a DCP rank runs, without the
collective) and Inductor.  Checks, per dtype: a ragged prefill and decode steps against
the same model run eagerly (max |logit difference| over max |logit|).  Times, in bf16:
one decode step at ``--context`` tokens for ``--batch`` sequences, and one prefill chunk
of ``--chunk`` tokens after that context, the cascade against plain ``torch.compile`` of
the same model (medians of CUDA-event timings).  On CUDA the cascade's prefix and window
run the Triton latent kernel (``dcp::latent_prefix_attention``, ``dcp::latent_window_attention``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import dcp_compile as dcp
from dcp_compile.models.llama import init_weights
from dcp_compile.models.mla import MLATransformer, deepseek_v2_lite_shape

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import log, median_ms  # noqa: E402


def build(args, dtype, device):
    cfg = deepseek_v2_lite_shape(n_layers=args.layers, max_batch=args.batch, max_seq_len=args.context + args.chunk + 64,
                                 vocab_size=args.vocab)
    torch.manual_seed(0)
    model = init_weights(MLATransformer(cfg, dtype=dtype, device=device), 0, std=0.02).eval()
    return cfg, model


def check(args, dtype, device) -> dict:
    """Prefill ragged prompts then ``--steps`` decode steps: cascade vs eager."""
    cfg, reference = build(args, dtype, device)
    _, model = build(args, dtype, device)
    group = dcp.DCPGroup(1, 0, device, None)
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
    compiled = torch.compile(model, backend=dcp.backend(group, cascade=True, lowering=args.lowering), fullgraph=True,
                             dynamic=False)
    gen = torch.Generator().manual_seed(1)
    width = min(256, args.context)
    prompt = torch.randint(0, cfg.vocab_size, (cfg.max_batch, width), generator=gen).to(device)
    positions = torch.arange(width, device=device).expand(cfg.max_batch, width).contiguous()
    lengths = torch.randint(width // 2, width + 1, (cfg.max_batch,), generator=gen).to(device)
    errors = []
    with torch.no_grad():
        a, b = compiled(prompt, positions), reference(prompt, positions)
        errors.append(float((a - b).abs().max() / b.abs().max()))
        for step in range(args.steps):
            tokens = torch.randint(0, cfg.vocab_size, (cfg.max_batch, 1), generator=gen).to(device)
            at = (lengths + step)[:, None]
            a, b = compiled(tokens, at), reference(tokens, at)
            errors.append(float((a - b).abs().max() / b.abs().max()))
    return dict(max_relative_error=max(errors), errors=errors)


def step_time(args, device, cascade: bool, tokens: int = 1) -> float:
    """Median milliseconds of one step of ``tokens`` new tokens a row after ``--context``
    for ``--batch`` rows (bf16)."""
    cfg, model = build(args, torch.bfloat16, device)
    if cascade:
        group = dcp.DCPGroup(1, 0, device, None)
        dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
        backend = dcp.backend(group, cascade=True, lowering=args.lowering)
    else:
        backend = args.lowering
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    ids = torch.zeros(cfg.max_batch, tokens, dtype=torch.long, device=device)
    at = (args.context + torch.arange(tokens, device=device)).expand(cfg.max_batch, tokens).contiguous()
    with torch.no_grad():
        return median_ms(lambda: compiled(ids, at), args.reps, warmup=3, cuda=device.type == "cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024, help="prefill chunk timed after the context (0: none)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--lowering", default=None)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.lowering = args.lowering or ("inductor" if device.type == "cuda" else "aot_eager")
    result = dict(env=dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
                  config=vars(args))
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        log(f"checking the cascade against eager in {name}")
        result[f"check_{name}"] = check(args, dtype, device)
        log(f"{name}: {result[f'check_{name}']['max_relative_error']:.2e}")
    for tokens, step in ((1, "step"), (args.chunk, "chunk")):
        if not tokens:
            continue
        for cascade in (False, True):
            name = "cascade" if cascade else "plain_compile"
            log(f"timing a {'decode step' if tokens == 1 else f'prefill chunk of {tokens}'}: {name}")
            result[f"{step}_ms_{name}"] = step_time(args, device, cascade, tokens)
            log(f"{name}: {result[f'{step}_ms_{name}']:.3f} ms")
            torch._dynamo.reset()
        result[f"{step}_cascade_over_plain"] = result[f"{step}_ms_cascade"] / result[f"{step}_ms_plain_compile"]
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
