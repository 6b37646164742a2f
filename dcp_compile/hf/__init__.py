"""Hugging Face ``transformers`` (5.x) causal LMs under DCP, unchanged.

Needs the ``hf`` extra (``pip install 'dcp-compile[hf]'``); ``import dcp_compile`` does
not import ``transformers``.  Tested with Llama, Qwen2/3, Mistral and Mixtral
(``sliding_window=None``), Phi-3, Granite, OLMo2, Gemma, StableLM, Cohere, GPT-NeoX, and
with multi-head latent attention (``cache_widths``) DeepSeek-V2/V3, MiniCPM3 and GLM-4
MoE Lite; ``attn_implementation="sdpa"`` or ``"eager"``.

Two ways in, both compiled with the ordinary backend:

**1. Your own loop, with a DCP static cache.**  HF models keep their KV tensors in the
cache object passed as ``past_key_values`` (``cache`` from 5.24 on), not in module
buffers.  ``DCPStaticCache`` is the drop-in for ``StaticCache`` that holds this rank's
``S_loc + 1`` slots per layer (a group of one: all ``max_cache_len`` slots)::

    group = dcp.init_group()
    cache = DCPStaticCache(model.config, group, max_batch_size=B, max_cache_len=S, dtype=torch.bfloat16, device=dev)
    model_c = torch.compile(model, backend=dcp.backend(group), fullgraph=True)
    logits = model_c(input_ids=prompt, past_key_values=cache).logits          # prefill
    logits = model_c(input_ids=next_ids, past_key_values=cache).logits        # decode, T = 1
    cache.reset()                                                               # next batch

As with ``StaticCache``, the batch shares one length (HF's cache position is 1-D).  A
2-D ``attention_mask`` (padding) is proven as a key mask over global positions; keep its
width fixed so one graph serves every step.  ``compile_for_generate`` makes
transformers' own ``model.generate()`` run this way.  Sliding-window layers (Mistral with ``sliding_window`` set, Qwen2 with
``use_sliding_window=True``) are refused by the passes, with the mask's source line.

**2. The ``(tokens, positions)`` interface.**  ``DCPCausalLM(model, max_batch=B,
max_seq_len=S, aux_layers=...)`` wraps the model and a cache of its own into
``forward(tokens [B, T], positions [B, T]) -> logits`` (or ``(logits, features)``), with
per-sequence positions: prompts of different lengths share a batch, and
``dcp.SpecDecoder`` takes it as its target.  The wrapper builds the position-causal
mask itself and writes every row at its own positions; its cache tensors are module
buffers, so ``dcp.prepare`` shards them like any model's.  EAGLE3 features are the
hidden states entering the ``aux_layers`` decoder layers (``n_layers``: the final
normed hidden state), taken by forward hooks, so the graph has no break.
"""

from dcp_compile.hf.cache import DCPStaticCache, DCPStaticLayer, KVStore, cache_kwarg, cache_widths, check_shardable
from dcp_compile.hf.causal_lm import DCPCausalLM, llama_config, load_causal_lm
from dcp_compile.hf.generate import compile_for_generate, left_padding_bound, static_width_masks

__all__ = [
    "DCPCausalLM",
    "DCPStaticCache",
    "DCPStaticLayer",
    "KVStore",
    "cache_kwarg",
    "cache_widths",
    "check_shardable",
    "compile_for_generate",
    "left_padding_bound",
    "llama_config",
    "load_causal_lm",
    "static_width_masks",
]
