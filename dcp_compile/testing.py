"""Shared factories and per-rank workers for the test suite, the demo and GPU checks.

Workers are module-level so spawned ranks can import them by name.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn

import dcp_compile as dcp
from dcp_compile.models import Llama, LlamaConfig, init_weights
from dcp_compile.runtime.generate import greedy_decode

PROMPT_LENGTHS = (5, 17, 30)

# Logit tolerances per dtype, written down once.  fp32: torch.testing's defaults.
# bf16: bounded relative to the unsharded bf16 model's own distance from float64
# (see gpu_parity_worker), not a fixed number.
FP32_TOLERANCE = MappingProxyType(dict(rtol=1.3e-6, atol=1e-5))


def make_prompts(lengths=PROMPT_LENGTHS, vocab: int = 256, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def make_model(cfg: LlamaConfig, seed: int = 0, dtype=torch.float32, device="cpu") -> Llama:
    return init_weights(Llama(cfg, dtype=torch.float32), seed).to(device=device, dtype=dtype).eval()


def capture_graph(model: nn.Module, *inputs):
    """The Dynamo FX graph of ``model(*inputs)`` and its real inputs, without running it."""
    from dcp_compile.runtime.prepare import trace_graph

    return trace_graph(model, inputs)


def parity_worker(rank: int, size: int, lowering: str, gqa: str, steps: int, interleave: int = 1) -> dict:
    """Greedy-decode the reference model sharded over ``size`` gloo ranks and unsharded."""
    group = dcp.init_group("cpu")
    cfg = LlamaConfig(gqa=gqa, max_batch=len(PROMPT_LENGTHS))
    prompts = make_prompts()
    reference = greedy_decode(make_model(cfg), prompts, steps)
    model = make_model(cfg)
    prepared = dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len, interleave=interleave)
    backend = dcp.backend(group, "target", lowering=lowering)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    result = greedy_decode(compiled, prompts, steps)
    return dict(
        tokens=result.tokens,
        reference_tokens=reference.tokens,
        logits=torch.stack(result.logits),
        reference_logits=torch.stack(reference.logits),
        cache_shapes=[tuple(model.layers[i].attention.k_cache.shape) for i in range(cfg.n_layers)],
        collectives=[_count_collectives(c.graph_module) for c in backend.compiled],
        prepared_bytes=prepared.kv_bytes,
    )


def _count_collectives(gm) -> int:
    from dcp_compile.passes.check import is_collective

    return sum(1 for n in gm.graph.nodes if is_collective(n))
