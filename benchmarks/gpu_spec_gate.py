"""The speculative-decoding correctness gate on GPUs: DCP=N over NCCL against the
size-1 off arm, in bf16, with EAGLE3 and EAGLE chain drafts (k=4).

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout 600 torchrun --nproc-per-node 2 benchmarks/gpu_spec_gate.py --json out.json
    timeout 600 torchrun --nproc-per-node 2 benchmarks/gpu_spec_gate.py --target mla --prompts 128 --json mla.json

Both arms decode the same prompts with the test pair of ``tests.support.agreeing_pair``
(a target and a draft built to agree most of the time, so every accept count occurs).
Rank 0 also runs the off arm (plain torch.compile semantics, group of size 1).  Reported:
the token-identity rate, per-step accept-count identity, mean accept lengths, and the
verdict of ``dcp_compile.commands.gate.evaluate`` (the paired accept-length criterion in bf16).

``--cuda-graphs``: the decoders capture their per-step calls.

``--target mla``: the MLA reference target with DeepSeek's latent widths (latent 512,
rope key 64, 16 heads, so the GPU runs the Triton latent kernel) and an EAGLE3 draft
(a Llama layer), greedy and sampled; ``--prompts N`` prompts of 3 to
``--max-prompt`` tokens, queued through ``max_batch`` rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import dcp_compile as dcp
from _report import parse_with_watchdog
from dcp_compile.commands.gate import evaluate
from dcp_compile.runtime.spec import SpecDecoder
from tests.support import agreeing_pair

FIXTURES = {"eagle3": dict(noise=3.0), "eagle": dict(noise=2.5, seed=2)}
MLA_SHAPE = dict(dim=256, n_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                 intermediate_size=512)
"""DeepSeek's latent widths on a small model: the latent kernel's shapes, a quick compile."""
PROMPT_LENGTHS = (3, 9, 14, 20, 40, 64, 100, 150)
K, NEW_TOKENS = 4, 64


def prompt_lengths(args) -> list[int]:
    if not args.prompts:
        return list(PROMPT_LENGTHS)
    gen = torch.Generator().manual_seed(3)
    return torch.randint(3, args.max_prompt + 1, (args.prompts,), generator=gen).tolist()


def decode(kind: str, group, device, temperature: float, dtype: torch.dtype, args):
    lengths = prompt_lengths(args)
    rows = min(len(lengths), args.max_batch)
    max_seq_len = max(lengths) + NEW_TOKENS + K + 8
    fixture = dict(FIXTURES[kind], max_batch=rows, max_seq_len=max_seq_len)
    if args.target == "mla":
        fixture.update(target="mla", mla_shape=MLA_SHAPE)
    target, draft = agreeing_pair(kind, **fixture)
    target, draft = target.to(device=device, dtype=dtype), draft.to(device=device, dtype=dtype)
    decoder = SpecDecoder(target, draft, group, k=K, max_batch=rows, max_seq_len=max_seq_len,
                          temperature=temperature, seed=5, lowering=args.lowering, cuda_graphs=args.cuda_graphs)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in lengths]
    start = time.perf_counter()
    outputs = dcp.generate_all(decoder, prompts, NEW_TOKENS)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return outputs, time.perf_counter() - start


def compare(dcp_out, off_out, dtype: str) -> dict:
    same_tokens = sum(a == b for x, y in zip(dcp_out, off_out) for a, b in zip(x.tokens, y.tokens))
    total = sum(len(y.tokens) for y in off_out)
    first_diff = [next((i for i, (a, b) in enumerate(zip(x.tokens, y.tokens)) if a != b), None) for x, y in zip(dcp_out, off_out)]
    verdict = evaluate([o.tokens for o in dcp_out], [o.accepted for o in dcp_out], [o.tokens for o in off_out],
                       [o.accepted for o in off_out], k=K, dtype=dtype)
    return dict(
        token_identity_rate=same_tokens / total,
        requests_identical=sum(x.tokens == y.tokens for x, y in zip(dcp_out, off_out)),
        requests=len(off_out),
        accept_counts_identical=sum(x.accepted == y.accepted for x, y in zip(dcp_out, off_out)),
        first_divergence=first_diff,
        mean_accept_length=dict(dcp=sum(o.mean_accept_length for o in dcp_out) / len(dcp_out),
                                off=sum(o.mean_accept_length for o in off_out) / len(off_out)),
        accept_count_histogram=dict(
            dcp=[sum(row.count(a) for row in (o.accepted for o in dcp_out)) for a in range(K + 1)],
            off=[sum(row.count(a) for row in (o.accepted for o in off_out)) for a in range(K + 1)],
        ),
        gate=verdict.as_dict(),
        verdict=verdict.describe(),
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--lowering", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--target", choices=("llama", "mla"), default="llama")
    parser.add_argument("--prompts", type=int, default=0, help="random prompt lengths instead of the fixed eight")
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--cuda-graphs", action="store_true", help="capture the decoders' per-step calls")
    args = parse_with_watchdog(parser)
    group = dcp.init_group()
    device, dtype = group.device, getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = dict(dcp_size=group.size, gpu=gpu, torch=torch.__version__,
                  triton=__import__("triton").__version__, dtype=args.dtype, k=K, new_tokens=NEW_TOKENS,
                  target=args.target, mla_shape=MLA_SHAPE if args.target == "mla" else None,
                  cuda_graphs=args.cuda_graphs,
                  prompt_lengths=prompt_lengths(args), arms={})
    arms = (("eagle3", 0.0), ("eagle3", 0.8)) if args.target == "mla" else (("eagle3", 0.0), ("eagle", 0.0), ("eagle3", 0.8))
    for kind, temperature in arms:
        dcp_out, dcp_seconds = decode(kind, group, device, temperature, dtype, args)
        if group.rank == 0:
            off_out, off_seconds = decode(kind, dcp.DCPGroup(1, 0, device, None), device, temperature, dtype, args)
            entry = compare(dcp_out, off_out, args.dtype)
            entry["seconds_with_compile"] = dict(dcp=dcp_seconds, off=off_seconds)
            report["arms"][f"{kind}_t{temperature}"] = entry
            print(kind, temperature, json.dumps(entry), flush=True)
            print(f"{args.target} {kind} t={temperature}: {entry['verdict']}", flush=True)
        torch._dynamo.reset()
    if group.rank == 0:
        print(json.dumps(report, indent=1), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # NCCL teardown at interpreter exit has hung on the lent machines; results are printed.
    os._exit(code)
