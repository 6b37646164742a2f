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
# (see benchmarks/gpu_parity.py), not a fixed number.
FP32_TOLERANCE = MappingProxyType(dict(rtol=1.3e-6, atol=1e-5))


def make_prompts(lengths=PROMPT_LENGTHS, vocab: int = 256, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def make_model(cfg: LlamaConfig, seed: int = 0, dtype=torch.float32, device="cpu", cache_device=None) -> Llama:
    if cache_device is not None:  # a meta cache cannot be moved: build on the device
        return init_weights(Llama(cfg, device=device, cache_device=cache_device), seed).to(dtype=dtype).eval()
    return init_weights(Llama(cfg, dtype=torch.float32), seed).to(device=device, dtype=dtype).eval()


def capture_graph(model: nn.Module, *inputs):
    """The Dynamo FX graph of ``model(*inputs)`` and its real inputs, without running it."""
    from dcp_compile.runtime.discovery import trace_graph

    return trace_graph(model, inputs)


def parity_worker(
    rank: int, size: int, lowering: str, gqa: str, steps: int, interleave: int = 1, comm: str = "ag",
    cache_device: str | None = None,
) -> dict:
    """Greedy-decode the reference model sharded over ``size`` gloo ranks and unsharded."""
    group = dcp.init_group("cpu")
    cfg = LlamaConfig(gqa=gqa, max_batch=len(PROMPT_LENGTHS))
    prompts = make_prompts()
    reference = greedy_decode(make_model(cfg), prompts, steps)
    model = make_model(cfg, cache_device=cache_device)
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len, interleave=interleave)
    backend = dcp.backend(group, "target", lowering=lowering, comm=comm)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    result = greedy_decode(compiled, prompts, steps)
    return dict(
        tokens=result.tokens,
        reference_tokens=reference.tokens,
        logits=torch.stack(result.logits),
        reference_logits=torch.stack(reference.logits),
        collectives=backend.collective_counts,
    )


def agreeing_pair(kind: str, *, noise: float, seed: int = 0, max_batch: int = 4, max_seq_len: int = 96,
                  target: str = "llama", mla_shape: dict | None = None, n_kv_heads: int = 2):
    """A target and an EAGLE/EAGLE3 draft that agree most of the time.

    The target is built to mostly repeat its input token: the LM head is the token
    embedding (an identity bigram), and the layers add ``noise``-scaled random updates
    that now and then change the argmax.  The draft passes the target's features
    through to the same head (EAGLE: fc keeps the final-hidden half of its input;
    EAGLE3: fc averages the three features), with its own noise.  Agreement is high
    but imperfect, so a batch sees every accept count from 0 to k.  For tests only: the weights are not a language model.
    ``target="mla"``: the target is the MLA reference (latent attention), the draft a
    Llama layer over its hidden states; ``mla_shape`` overrides its ``MLAConfig`` fields
    (a latent of 512 and a rope key of 64 reach the GPU's latent kernel).  ``n_kv_heads``:
    the Llama target's KV heads (its 4 query heads share them).
    """
    from dcp_compile.models import DraftConfig, EagleDraft, eagle3_aux_layers

    n_layers = 4
    aux = eagle3_aux_layers(n_layers) if kind == "eagle3" else (n_layers,)
    if target == "mla":
        from dcp_compile.models.mla import MLAConfig, MLATransformer, draft_config

        cfg = MLAConfig(**dict(dict(vocab_size=32, dim=64, n_heads=4, intermediate_size=96, n_layers=n_layers,
                                    max_seq_len=max_seq_len, max_batch=max_batch, aux_layers=aux), **(mla_shape or {})))
        draft_cfg = draft_config(cfg, kind, n_features=len(aux))
        target = init_weights(MLATransformer(cfg), seed).eval()
    else:
        cfg = LlamaConfig(vocab_size=32, dim=64, n_heads=4, n_kv_heads=n_kv_heads, intermediate_size=96, n_layers=n_layers,
                          max_seq_len=max_seq_len, max_batch=max_batch, aux_layers=aux)
        draft_cfg = DraftConfig(cfg, kind, n_features=len(aux))
        target = make_model(cfg, seed)
    draft = init_weights(EagleDraft(draft_cfg), seed + 1).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 2)
        embedding = torch.randn(cfg.vocab_size, cfg.dim, generator=gen)
        target.tok_embeddings.weight.copy_(embedding)
        target.output.weight.copy_(4.0 * embedding / embedding.norm(dim=1, keepdim=True))
        for layer in target.layers:
            layer.attention.wo.weight.mul_(noise)
            layer.feed_forward.w2.weight.mul_(noise)
        draft.embed.weight.copy_(embedding)
        draft.head.weight.copy_(target.output.weight)
        eye = torch.eye(cfg.dim)
        if kind == "eagle":
            draft.fc.weight.copy_(torch.cat([torch.zeros_like(eye), eye], dim=1))
        else:
            draft.fc.weight.copy_(torch.cat([eye / len(aux)] * len(aux), dim=1))
        draft.attention.wo.weight.mul_(noise)
        draft.feed_forward.w2.weight.mul_(noise)
    return target, draft
