"""The fp32 trajectory of gpu_cuda_graphs.py's prompts, on CPU: DCP=2 (gloo) against the off arm.

    python benchmarks/spec_fp32_reference.py

Same pair (tiny-code), prompts, k and length as ``gpu_cuda_graphs.py``, in float32 with
``aot_eager``: what the bf16 GPU runs would give without rounding.
"""

from __future__ import annotations

import json

import torch

import dcp_compile as dcp
from dcp_compile.models.pretrained import load_pair
from dcp_compile.runtime.launch import spawn_ranks
from dcp_compile.runtime.spec import SpecDecoder
from gpu_cuda_graphs import K, NEW, PROMPTS


def worker(rank: int, size: int) -> dict:
    group = dcp.init_group("cpu")
    prompts = [list(p) for p in PROMPTS]
    max_seq_len = max(map(len, prompts)) + NEW + K + 1
    target, draft = load_pair("tiny-code", max_batch=len(prompts), max_seq_len=max_seq_len, device="cpu",
                              dtype=torch.float32)
    decoder = SpecDecoder(target, draft, group, k=K, max_batch=len(prompts), max_seq_len=max_seq_len,
                          lowering="aot_eager", check_ranks=True)
    outputs = dcp.generate_all(decoder, prompts, NEW)
    return dict(tokens=[o.tokens for o in outputs], accepted=[o.accepted for o in outputs],
                accept_len=sum(a + 1 for o in outputs for a in o.accepted) / sum(len(o.accepted) for o in outputs))


def main() -> None:
    sharded = spawn_ranks(worker, 2, timeout=900)[0]
    off = spawn_ranks(worker, 1, timeout=900)[0]
    print(json.dumps(dict(accept_len_dcp2=round(sharded["accept_len"], 3), accept_len_off=round(off["accept_len"], 3),
                          tokens_identical=sharded["tokens"] == off["tokens"],
                          accepts_identical=sharded["accepted"] == off["accepted"])))


if __name__ == "__main__":
    main()
