"""A Hugging Face Llama-architecture directory as this package's own ``Llama``, so that
``dcp.tensor_parallel`` can shard it (``--tp`` on a Hugging Face or GGUF model).

The weights are read from the directory's safetensors as they are, renamed, with one
change: transformers rotates the halves of each head and this package rotates interleaved
pairs, so the ``q_proj``/``k_proj`` rows are permuted per head (``models/rope_layout.py``);
the outputs are unchanged.  Tied embeddings (``tie_word_embeddings``, as SmolLM2's) give
the LM head the embedding's values.

Only what ``Llama`` computes is taken: the ``llama`` model type, SiLU, no biases, plain
RoPE; anything else is refused by name, with the route that works (``--dcp`` alone, every
rank holding the weights, through ``DCPCausalLM``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dcp_compile.hf.causal_lm import llama_config
from dcp_compile.models.eagle_checkpoint import LAYER_NAMES, weight_files
from dcp_compile.models.llama import Llama
from dcp_compile.models.rope_layout import rotate_half_to_interleaved

ROUTE = "serve it with --dcp alone (every rank holds the weights), or shard it with transformers' own TP and drive " \
        "dcp.prepare / dcp.backend from Python (docs/tensor-parallel.md)"


def check(config) -> None:
    """Refuse, by name, a config whose model ``Llama`` does not compute."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    found = []
    if getattr(text, "model_type", None) != "llama":
        found.append(f"model_type {getattr(text, 'model_type', None)!r} (not 'llama')")
    if getattr(text, "hidden_act", "silu") != "silu":
        found.append(f"hidden_act {text.hidden_act!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(text, flag, False):
            found.append(f"{flag}=True")
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        found.append(f"RoPE scaling of type {rope.get('rope_type', rope.get('type'))!r}")
    if found:
        raise ValueError(
            f"dcp.tensor_parallel shards this package's own Llama, which this model's weights do not fit: "
            f"{', '.join(found)}; {ROUTE}"
        )


def _read(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for path in weight_files(directory, "model"):
        if path.suffix != ".safetensors":
            raise ValueError(f"{path}: the package reads Hugging Face weights from .safetensors files only")
        state |= load_file(str(path))
    return {name[len("model."):] if name.startswith("model.") else name: t for name, t in state.items()}


def load_llama(directory, *, max_batch: int, max_seq_len: int, aux_layers: tuple[int, ...] = (),
               dtype: torch.dtype = torch.float32, device=None, cache_device=None) -> Llama:
    """The Hugging Face Llama in ``directory`` as ``Llama`` with caches for ``max_batch``
    rows of ``max_seq_len`` positions, in ``dtype``, in eval mode, built on ``device``
    (``cache_device="meta"``: its caches left for ``dcp.prepare`` to allocate)."""
    from transformers import AutoConfig

    directory = Path(directory)
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    check(config)
    cfg = llama_config(config, max_batch=max_batch, max_seq_len=max_seq_len, aux_layers=aux_layers)
    hf = _read(directory)
    state = {"tok_embeddings.weight": hf.pop("embed_tokens.weight"), "norm.weight": hf.pop("norm.weight")}
    state["output.weight"] = hf.pop("lm_head.weight", state["tok_embeddings.weight"])
    heads = {"self_attn.q_proj.weight": cfg.n_heads, "self_attn.k_proj.weight": cfg.n_kv_heads}
    for i in range(cfg.n_layers):
        names = dict(LAYER_NAMES, **{"input_layernorm.weight": "attention_norm.weight"})
        for theirs, ours in names.items():
            tensor = hf.pop(f"layers.{i}.{theirs}")
            state[f"layers.{i}.{ours}"] = rotate_half_to_interleaved(tensor, heads[theirs]) if theirs in heads else tensor
    left = sorted(name for name in hf if "rotary_emb" not in name)
    if left:
        raise ValueError(f"{directory}: weights Llama has no place for: {', '.join(left[:6])}"
                         f"{' ...' if len(left) > 6 else ''}; {ROUTE}")
    model = Llama(cfg, dtype=dtype, device=device, cache_device=cache_device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: the weights do not fill Llama: missing {sorted(missing)[:6]}, unexpected "
                         f"{sorted(unexpected)[:6]}; {ROUTE}")
    return model.eval().requires_grad_(False)
