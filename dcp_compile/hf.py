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

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn

try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "dcp_compile.hf needs Hugging Face transformers 5.x: pip install 'dcp-compile[hf]'"
    ) from error

from dcp_compile.layout import KVLayout
from dcp_compile.models.eagle import DraftConfig
from dcp_compile.models.llama import LlamaConfig
from dcp_compile.ops.guard import guard
from dcp_compile.records import CacheRecord, register
from dcp_compile.group import DCPGroup

_SUPPORTED_LAYERS = ("full_attention", "sliding_attention")


_WHY_NOT_SHARDED = MappingProxyType({
    "indexed_attention": "an indexer picks the cached slots each token attends to (DeepSeek-V3.2's sparse attention)",
    "deepseek_sparse_attention": "an indexer picks the cached slots each token attends to",  # before transformers 5.24
    "compressed_sparse_attention": "sparse attention over a compressed cache",
    "heavily_compressed_attention": "attention over a compressed cache",
    "minimax_m3_sparse": "an indexer picks the cached slots each token attends to",
    "chunked_attention": "attention within chunks, not over the whole context",
    "linear_attention": "a recurrent state, not a KV cache",
    "hybrid": "attention combined with a recurrent state",
    "hybrid_sliding": "sliding attention combined with a recurrent state",
})
"""Why a layer type that is not full or sliding attention cannot take a DCP cache."""


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        sliding = getattr(config, "sliding_window", None) is not None
        return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers
    return list(types)


def cache_widths(config) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(heads, width)`` of the keys and of the values one layer caches.

    Multi-head latent attention in transformers (DeepSeek-V2/V3, Kimi-K2 and kin:
    configs with ``kv_lora_rank``) caches the normed latent where other models cache keys,
    and the rope key where they cache values, one head each; every step expands them per
    head with ``kv_b_proj`` (the passes shard that expansion with the cache)."""
    if getattr(config, "kv_lora_rank", None):
        return (1, config.kv_lora_rank), (1, config.qk_rope_head_dim)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return (heads, _head_dim(config)), (heads, _head_dim(config))


class KVStore(nn.Module):
    """The cache tensors as buffers ``k_0, v_0, k_1, ...``, so that ``dcp.prepare`` can
    swap them for local ones like any model's buffers."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], tuple[int, ...]]], dtype: torch.dtype, device):
        """``shapes``: per layer, the key and the value tensors' shapes."""
        super().__init__()
        for i, (key_shape, value_shape) in enumerate(shapes):
            self.register_buffer(f"k_{i}", torch.zeros(key_shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"v_{i}", torch.zeros(value_shape, dtype=dtype, device=device), persistent=False)


class DCPStaticLayer(CacheLayerMixin):
    """One decoder layer's slot in a ``DCPStaticCache``; its tensors live in the store."""

    is_compileable = True
    is_croppable = False

    def __init__(self, store: KVStore, index: int, *, sliding: bool, max_batch_size: int, max_cache_len: int):
        # CacheLayerMixin.__init__ would assign keys/values, which here are views of the store.
        self._store, self._index = store, index
        self.is_sliding = sliding
        self.is_initialized = True
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len

    @property
    def keys(self) -> torch.Tensor:
        return getattr(self._store, f"k_{self._index}")

    @property
    def values(self) -> torch.Tensor:
        return getattr(self._store, f"v_{self._index}")

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def lazy_initialization(self, key_states, value_states) -> None:
        pass  # allocated up front: the local shape must exist before torch.compile traces

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("DCPStaticCache writes through DCPStaticCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self):
        raise RuntimeError("DCPStaticCache tracks one length for every layer: use the cache's get_seq_length")

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.keys.zero_()
        self.values.zero_()


class DCPStaticCache(Cache):
    """A ``StaticCache`` whose tensors are this rank's DCP shard.

    Args:
        config: the model's config (its text config for multimodal models).
        group: from ``dcp.init_group()``.  ``None``: whole tensors, not yet prepared
            (``DCPCausalLM`` owns such a cache and ``dcp.prepare`` shards it).
        max_batch_size: batch rows.
        max_cache_len: global sequence capacity ``S``.
        dtype, device: of the cache tensors (the model's).
        interleave: ``I`` of the KV layout.
        verify_tokens: staging slots for verify graphs (``k + 1`` for a chain of ``k``).

    Every layer writes with ``index_copy_`` along the sequence axis at
    ``arange(T) + length``, where ``length`` is one tensor shared by all layers (and by
    the mask HF builds from ``get_seq_length``); the last layer advances it.
    """

    is_compileable = True

    def __init__(
        self,
        config,
        group: DCPGroup | None = None,
        *,
        max_batch_size: int,
        max_cache_len: int,
        dtype: torch.dtype = torch.float32,
        device=None,
        interleave: int = 1,
        verify_tokens: int = 0,
    ):
        config = _text_config(config)
        types = _layer_types(config)
        unknown = sorted(set(types) - set(_SUPPORTED_LAYERS))
        if unknown:
            why = "; ".join(f"{t}: {_WHY_NOT_SHARDED.get(t, 'not a full causal attention over a KV cache')}" for t in unknown)
            raise ValueError(
                f"DCPStaticCache shards the caches of full causal attention layers; {type(config).__name__} has layer "
                f"types {unknown} ({why}), which DCP does not shard"
            )
        sharded = group is not None and group.size > 1
        layout = KVLayout(group.size, group.rank, max_cache_len, interleave) if sharded else KVLayout(1, 0, max_cache_len)
        slots = layout.local_cache_len + verify_tokens if sharded else max_cache_len
        widths = cache_widths(config)
        shapes = tuple((max_batch_size, heads, slots, width) for heads, width in widths)
        self.store = KVStore([shapes] * config.num_hidden_layers, dtype, device)
        layers = [
            DCPStaticLayer(self.store, i, sliding=t == "sliding_attention", max_batch_size=max_batch_size,
                           max_cache_len=max_cache_len)
            for i, t in enumerate(types)
        ]
        super().__init__(layers=layers)
        self.length = torch.zeros((), dtype=torch.long, device=device)
        """Tokens written so far (every row: the batch shares one length)."""
        self.row_positions: torch.Tensor | None = None
        """Set by ``DCPCausalLM`` for one call: per-row positions ``[B, T]`` to write at."""
        self.layout = layout
        if group is not None:
            for name, tensor in self.store.named_buffers():
                heads, width = widths[0] if name.startswith("k_") else widths[1]
                record = CacheRecord(f"cache.{name}", "target", 2, layout, (max_batch_size, heads, max_cache_len, width),
                                     verify_tokens if sharded else 0)
                register(tensor, record)

    @property
    def kv_length(self) -> int:
        """Slots per row of every cache tensor (this rank's, when sharded)."""
        return self.store.k_0.shape[2]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        keys, values = layer.keys, layer.values
        if key_states.shape[0] != keys.shape[0]:
            raise ValueError(
                f"batch of {key_states.shape[0]} rows, but the model was prepared for max_batch={keys.shape[0]}: the "
                f"DCPStaticCache holds {keys.shape[0]} rows. Split the batch, or build the cache with "
                f"max_batch_size={key_states.shape[0]}"
            )
        expected = (keys.shape[1], keys.shape[3], values.shape[1], values.shape[3])
        found = (key_states.shape[1], key_states.shape[3], value_states.shape[1], value_states.shape[3])
        if found != expected:
            raise ValueError(
                f"layer {layer_idx} writes keys of {found[0]} heads x {found[1]} and values of {found[2]} x {found[3]}, "
                f"but the DCPStaticCache was sized from the config for keys of {expected[0]} x {expected[1]} and values "
                f"of {expected[2]} x {expected[3]} (num_key_value_heads or num_attention_heads, head_dim or hidden_size "
                f"// num_attention_heads; kv_lora_rank and qk_rope_head_dim for latent attention): build it from the "
                f"config the model was built with"
            )
        if self.layout.size > 1:
            # Only a graph dcp.backend compiled may write a shard: every other route
            # (an uncompiled or half-compiled loop) stops here, before the write.  (A
            # DCPCausalLM's cache is sharded by dcp.prepare, whose hook guards the calls.)
            if not torch.compiler.is_compiling():
                guard(key_states, "DCPStaticCache")
            key_states, value_states = guard(key_states, "DCPStaticCache"), guard(value_states, "DCPStaticCache")
        if self.row_positions is not None:
            # [B, T] positions: row b writes its own (the reference Llama's form).
            rows = torch.arange(keys.shape[0], device=keys.device)[:, None]
            keys[rows, :, self.row_positions] = key_states.transpose(1, 2)
            values[rows, :, self.row_positions] = value_states.transpose(1, 2)
            return keys, values
        tokens = key_states.shape[-2]
        positions = torch.arange(tokens, device=keys.device) + self.length
        keys.index_copy_(2, positions, key_states)
        values.index_copy_(2, positions, value_states)
        if layer_idx == len(self.layers) - 1:
            self.length.add_(tokens)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0):
        return self.length

    def get_query_offset(self, layer_idx: int = 0):
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.kv_length, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].max_cache_len

    @property
    def max_cache_len(self) -> int:
        """Global sequence capacity ``S`` (every rank's shard together)."""
        return self.layers[0].max_cache_len

    def _refuse(self, what: str, used_by: str):
        raise ValueError(
            f"DCPStaticCache cannot {what} ({used_by}): its rows and slots are this rank's shard, written only by "
            f"graphs dcp.backend compiled. Use greedy search or sampling (num_beams=1, no assistant model)"
        )

    def reorder_cache(self, beam_idx):
        self._refuse("reorder its rows", "beam search")

    def crop(self, max_length: int):
        self._refuse("be cropped", "assisted generation and prompt lookup")

    def batch_repeat_interleave(self, repeats: int):
        self._refuse("repeat its rows", "beam search and num_return_sequences > 1 with a filled cache")

    def batch_select_indices(self, indices):
        self._refuse("select rows", "contrastive search")

    def reset(self) -> None:
        """Forget every sequence (the slots are zeroed too, as ``StaticCache.reset`` does)."""
        self.length.zero_()
        for layer in self.layers:
            layer.reset()


def static_width_masks(config, inputs_embeds, attention_mask, cache=None, position_ids=None, *, past_key_values=None,
                       **kwargs):
    """``generate``'s mask hook (``create_masks_for_generate``) for a ``DCPStaticCache``:
    the 2-D padding mask, right-padded with False to the cache's global capacity.

    Transformers' default builds a 4-D mask outside the compiled forward, over the cache
    tensors' slots, which under DCP are this rank's shard: a mask the passes cannot
    read.  The 2-D mask instead goes into the graph, where the model builds causal AND
    ``mask[b, s]``; the passes prove that form and read the padding at the global
    position each local slot holds.  A fixed width keeps one graph for every decode step
    (the mask ``generate`` keeps grows by a column each step).  Any other cache gets
    transformers' own masks.  ``generate`` passes the cache as ``cache`` from
    transformers 5.24 on, as ``past_key_values`` before."""
    from transformers.masking_utils import create_masks_for_generate

    cache = cache if cache is not None else past_key_values
    if not isinstance(cache, DCPStaticCache):
        return create_masks_for_generate(config, inputs_embeds, attention_mask, cache, position_ids, **kwargs)
    rows = cache.store.k_0.shape[0]
    if inputs_embeds.shape[0] != rows:
        raise ValueError(
            f"generate() runs a batch of {inputs_embeds.shape[0]} rows, but the DCPStaticCache holds {rows}: beam search "
            f"and num_return_sequences multiply the rows (beam search is not supported under DCP). Build the cache with "
            f"max_batch_size={inputs_embeds.shape[0]}, or pass that many prompts"
        )
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[1] > cache.max_cache_len:
        raise ValueError(
            f"generate under DCP takes a 2-D attention_mask [batch, tokens] of at most max_cache_len="
            f"{cache.max_cache_len} columns; got shape {tuple(attention_mask.shape)}. Build the DCPStaticCache with a "
            f"larger max_cache_len, or ask for fewer new tokens"
        )
    padded = torch.zeros(attention_mask.shape[0], cache.max_cache_len, dtype=torch.bool, device=attention_mask.device)
    padded[:, : attention_mask.shape[1]] = attention_mask.bool()
    return padded


def compile_for_generate(model: nn.Module, group: DCPGroup, **backend_options):
    """Make ``model.generate(..., cache=DCPStaticCache(...))`` run under DCP (the keyword is
    ``past_key_values`` before transformers 5.24: ``cache_kwarg(model)`` names it).

    - ``model.forward`` is compiled by ``dcp.backend(group, **backend_options)`` with
      ``fullgraph=True, dynamic=False``, so the prefill and every decode step run
      through the passes (transformers' own auto-compile compiles only the decode, with
      its own backend; it is switched off here);
    - ``generate``'s masks come from ``static_width_masks``: a left-padded batch works.

    Greedy search and sampling work, with ``max_new_tokens``, ``eos_token_id`` and the
    usual logits processors; beam search and assisted generation are refused by the
    cache.  The model is changed in place; returns the backend (its compiled graphs and
    collective counts).
    """
    from dcp_compile.backend import backend

    dcp_backend = backend(group, **backend_options)
    model.forward = torch.compile(model.forward, backend=dcp_backend, fullgraph=True, dynamic=False)
    model.create_masks_for_generate = static_width_masks
    model.generation_config.disable_compile = True
    model.generate = _refusing_unsupported_modes(model.generate, model)
    return dcp_backend


_UNSUPPORTED_MODES = (
    ("num_beams", lambda v: v is not None and v > 1, "beam search (num_beams > 1) reorders the cache's rows"),
    ("assistant_model", lambda v: v is not None, "assisted generation crops the cache"),
    ("prompt_lookup_num_tokens", lambda v: v is not None, "prompt-lookup decoding crops the cache"),
    ("penalty_alpha", lambda v: v is not None and v > 0, "contrastive search selects cache rows"),
)


def _refusing_unsupported_modes(generate, model):
    """``generate`` that refuses, before the prefill writes anything, the modes that move
    or crop the cache's rows: they would need the cache whole."""
    import functools

    @functools.wraps(generate)
    def checked(*args, **kwargs):
        config = kwargs.get("generation_config") or model.generation_config
        for name, unsupported, why in _UNSUPPORTED_MODES:
            value = kwargs.get(name, getattr(config, name, None))
            if unsupported(value):
                raise ValueError(
                    f"generate() under DCP supports greedy search and sampling; {name}={value!r} asks for another "
                    f"mode: {why}, and every rank holds only its shard of them. Use num_beams=1 without an assistant"
                )
        return generate(*args, **kwargs)

    return checked


def check_shardable(config) -> None:
    """Refuse, with the reason, a model whose attention DCP does not shard here: layer
    types other than full causal attention (sparse, linear, chunked, hybrid) and
    sliding windows.  Reads the config only."""
    config = _text_config(config)
    unknown = sorted(set(_layer_types(config)) - set(_SUPPORTED_LAYERS))
    if unknown:
        why = "; ".join(f"{t}: {_WHY_NOT_SHARDED.get(t, 'not a full causal attention over a KV cache')}" for t in unknown)
        raise ValueError(
            f"{type(config).__name__} has layer types {unknown} ({why}), which DCP does not shard: it shards the "
            f"caches of full causal attention layers"
        )
    _refuse_sliding(config)


def load_causal_lm(directory, *, device, dtype: torch.dtype) -> nn.Module:
    """A Hugging Face causal-LM directory, read by transformers from disk only (never the
    hub), in ``dtype`` straight onto ``device`` (the safetensors are mapped, not copied
    into host memory first), with SDPA attention, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    check_shardable(config)
    device = torch.device(device)
    # On a GPU, a device map (through accelerate, in the hf extra) puts each tensor on the
    # device as it is read, so host memory never holds the model; on the CPU the model is
    # the one copy.
    placement = {"device_map": {"": device}} if device.type != "cpu" else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=dtype, attn_implementation="sdpa", local_files_only=True, **placement,
    )
    return model.eval().requires_grad_(False)


def _refuse_sliding(config) -> None:
    types = _layer_types(config)
    if any(t != "full_attention" for t in types):
        raise ValueError(
            f"{type(config).__name__} uses sliding-window attention (layer_types {sorted(set(types))}, sliding_window="
            f"{getattr(config, 'sliding_window', None)}); DCPCausalLM builds a full causal mask and would drop the window. "
            f"DCP shards full causal attention only: set sliding_window=None (Mistral) or use_sliding_window=False (Qwen2) "
            f"if your contexts never exceed the window"
        )


def llama_config(config, *, max_batch: int, max_seq_len: int, aux_layers: tuple[int, ...] = ()) -> LlamaConfig:
    """An HF config's shapes as the reference ``LlamaConfig``: what an EAGLE draft, itself
    a Llama decoder layer, is sized from (``DCPCausalLM.draft_config``)."""
    config = _text_config(config)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", None) or getattr(config, "rope_theta", 10000.0)
    if getattr(config, "kv_lora_rank", None):
        raise ValueError(
            f"{type(config).__name__} uses multi-head latent attention (kv_lora_rank={config.kv_lora_rank}); an EAGLE "
            f"draft is a Llama decoder layer, whose heads and head width this config does not give. Build the draft's "
            f"DraftConfig from a LlamaConfig of the trained draft's shapes (dim={config.hidden_size}, its n_heads)"
        )
    if _head_dim(config) * config.num_attention_heads != config.hidden_size:
        raise ValueError(
            f"head_dim {_head_dim(config)} x {config.num_attention_heads} heads != hidden_size {config.hidden_size}: the "
            f"reference LlamaConfig (and EAGLE drafts built from it) assume head_dim = hidden_size / heads"
        )
    return LlamaConfig(
        vocab_size=config.vocab_size, dim=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads, n_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        intermediate_size=config.intermediate_size, max_seq_len=max_seq_len, max_batch=max_batch, rope_theta=float(theta),
        norm_eps=getattr(config, "rms_norm_eps", 1e-6), aux_layers=tuple(aux_layers),
    )


def cache_kwarg(model) -> str:
    """The name the model's forward takes its cache by: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class DCPCausalLM(nn.Module):
    """An HF causal LM as ``forward(tokens [B, T], positions [B, T]) -> logits [B, T, V]``
    (fp32), or ``(logits, features [B, T, len(aux_layers) * hidden])`` with ``aux_layers``.

    It is a ``SpecDecoder`` target (``vocab_size``, ``feature_width``);
    ``EagleDraft(wrapper.draft_config("eagle3"))`` builds a draft sized for it.
    """

    def __init__(self, model: nn.Module, *, max_batch: int, max_seq_len: int, aux_layers: tuple[int, ...] = ()):
        super().__init__()
        config = _text_config(model.config)
        if config._attn_implementation != "sdpa":
            raise ValueError(
                f"DCPCausalLM needs attn_implementation='sdpa', got {config._attn_implementation!r}: load the model with "
                f"from_pretrained(..., attn_implementation='sdpa')"
            )
        _refuse_sliding(config)
        self.model = model
        self.config = config
        self.aux_layers = tuple(aux_layers)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        param = next(model.parameters())
        self.cache = DCPStaticCache(config, None, max_batch_size=max_batch, max_cache_len=max_seq_len, dtype=param.dtype,
                                    device=param.device)
        self.kv = self.cache.store
        self._cache_kwarg = cache_kwarg(model)
        self._features: dict[int, torch.Tensor] = {}
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self._hooks = [
            decoder.layers[i].register_forward_pre_hook(self._keep_input(i), with_kwargs=True)
            if i < config.num_hidden_layers else decoder.norm.register_forward_hook(self._keep_output(i))
            for i in aux_layers
        ]

    def remove_hooks(self) -> None:
        """Take the feature hooks off the wrapped model, giving it back as it was; the
        wrapper returns no features after this."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.aux_layers = ()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def feature_width(self) -> int:
        """Width of the EAGLE features forward returns (0: it returns the logits alone)."""
        return self.config.hidden_size * len(self.aux_layers)

    # What an EAGLE draft reads of the target it is loaded for (``eagle.DraftHost``).

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def cache_shape(self) -> tuple[int, int]:
        """``(max_batch, max_seq_len)``: the rows and positions of the cache."""
        return self.max_batch, self.max_seq_len

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    def draft_config(self, kind: str = "eagle3", **options) -> DraftConfig:
        """A ``DraftConfig`` for an EAGLE draft of this model (its width, heads, vocabulary,
        cache size and, for EAGLE3, the features this wrapper returns); ``options`` go to
        ``DraftConfig`` (``draft_vocab_size``, ``n_features``)."""
        shapes = llama_config(self.config, max_batch=self.max_batch, max_seq_len=self.max_seq_len,
                              aux_layers=self.aux_layers)
        return DraftConfig(shapes, kind, **options)

    def _keep_input(self, index: int):
        def hook(module, args, kwargs):
            self._features[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _keep_output(self, index: int):
        def hook(module, args, output):
            self._features[index] = output

        return hook

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, logits_at: torch.Tensor | None = None):
        """``logits_at [B, K]``: logits only at those indices of each row, ``[B, K, V]``
        (a prefill chunk needs its last position's).  HF's ``logits_to_keep`` takes one
        index list for every row, so the model computes the ``B * K`` requested rows for
        each sequence and each keeps its own: ``B * K`` vocabulary rows per sequence
        instead of ``T``."""
        slots = torch.arange(self.cache.kv_length, device=tokens.device)
        mask = slots[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]: position-causal
        keep = {} if logits_at is None else {"logits_to_keep": logits_at.flatten()}
        self.cache.row_positions = positions
        out = self.model(
            input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
            **{self._cache_kwarg: self.cache}, **keep,
        )
        self.cache.row_positions = None
        logits = out.logits.float()
        if logits_at is not None:
            B, K = logits_at.shape
            rows = torch.arange(B, device=tokens.device)
            logits = logits.view(B, B, K, -1)[rows, rows]
        if not self.aux_layers:
            return logits
        features = torch.cat([self._features[i] for i in self.aux_layers], dim=-1)
        self._features.clear()
        return logits, features


__all__ = [
    "DCPCausalLM", "DCPStaticCache", "KVStore", "cache_kwarg", "check_shardable", "compile_for_generate", "llama_config",
    "load_causal_lm", "static_width_masks", "transformers",
]
