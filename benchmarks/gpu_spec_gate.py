"""The speculative-decoding correctness gate on GPUs: DCP=N over NCCL against the
size-1 off arm, in bf16, with EAGLE3 and EAGLE chain drafts (k=4).

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout 600 torchrun --nproc-per-node 2 benchmarks/gpu_spec_gate.py --json out.json

Both arms decode the same prompts with the test pair of ``tests.support.agreeing_pair``
(a target and a draft built to agree most of the time, so every accept count occurs).
Rank 0 also runs the off arm (plain torch.compile semantics, group of size 1).  Reported:
the token-identity rate, per-step accept-count identity, and mean accept lengths.
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
from dcp_compile.runtime.spec import SpecDecoder
from tests.support import agreeing_pair

FIXTURES = {"eagle3": dict(noise=3.0), "eagle": dict(noise=2.5, seed=2)}
PROMPT_LENGTHS = (3, 9, 14, 20, 40, 64, 100, 150)
K, NEW_TOKENS = 4, 64


def decode(kind: str, group, device, temperature: float, dtype: torch.dtype, lowering: str):
    target, draft = agreeing_pair(kind, **FIXTURES[kind], max_batch=len(PROMPT_LENGTHS), max_seq_len=256)
    target, draft = target.to(device=device, dtype=dtype), draft.to(device=device, dtype=dtype)
    decoder = SpecDecoder(target, draft, group, k=K, max_batch=len(PROMPT_LENGTHS), max_seq_len=256,
                          temperature=temperature, seed=5, lowering=lowering)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    start = time.perf_counter()
    outputs = decoder.generate(prompts, NEW_TOKENS)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return outputs, time.perf_counter() - start


def compare(dcp_out, off_out) -> dict:
    same_tokens = sum(a == b for x, y in zip(dcp_out, off_out) for a, b in zip(x.tokens, y.tokens))
    total = sum(len(y.tokens) for y in off_out)
    first_diff = [next((i for i, (a, b) in enumerate(zip(x.tokens, y.tokens)) if a != b), None) for x, y in zip(dcp_out, off_out)]
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
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--lowering", choices=("inductor", "aot_eager"), default="inductor")
    args = parse_with_watchdog(parser)
    group = dcp.init_group()
    device, dtype = group.device, getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = dict(dcp_size=group.size, gpu=gpu, torch=torch.__version__,
                  triton=__import__("triton").__version__, dtype=args.dtype, k=K, new_tokens=NEW_TOKENS,
                  prompt_lengths=PROMPT_LENGTHS, arms={})
    for kind, temperature in (("eagle3", 0.0), ("eagle", 0.0), ("eagle3", 0.8)):
        dcp_out, dcp_seconds = decode(kind, group, device, temperature, dtype, args.lowering)
        if group.rank == 0:
            off_out, off_seconds = decode(kind, dcp.DCPGroup(1, 0, device, None), device, temperature, dtype, args.lowering)
            entry = compare(dcp_out, off_out)
            entry["seconds_with_compile"] = dict(dcp=dcp_seconds, off=off_seconds)
            report["arms"][f"{kind}_t{temperature}"] = entry
            print(kind, temperature, json.dumps(entry), flush=True)
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
