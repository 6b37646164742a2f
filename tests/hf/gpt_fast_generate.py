"""The calls of gpt-fast's ``generate.py`` that drive a model, kept in its idiom: the
sampling helpers, ``prefill`` and ``decode_one_token``, and the way it compiles them
(``torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)``,
``torch.compile(prefill, fullgraph=True, dynamic=True)``)."""

from __future__ import annotations

import torch


def multinomial_sample_one_no_sync(probs_sort):
    q = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / q, dim=-1, keepdim=True).to(dtype=torch.int)


def logits_to_probs(logits, temperature: float = 1.0, top_k: int | None = None):
    logits = logits / max(temperature, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    return torch.nn.functional.softmax(logits, dim=-1)


def sample(logits, temperature: float = 1.0, top_k: int | None = None):
    probs = logits_to_probs(logits[:, -1], temperature, top_k)
    return multinomial_sample_one_no_sync(probs), probs


def prefill(model, x, input_pos, **sampling_kwargs):
    logits = model(x, input_pos)
    return sample(logits, **sampling_kwargs)[0]


def decode_one_token(model, x, input_pos, **sampling_kwargs):
    assert input_pos.shape[-1] == 1
    logits = model(x, input_pos)
    return sample(logits, **sampling_kwargs)


def compiled_like_generate_py():
    """``decode_one_token`` and ``prefill`` compiled as ``generate.py --compile --compile_prefill`` does."""
    return (torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True),
            torch.compile(prefill, fullgraph=True, dynamic=True))
