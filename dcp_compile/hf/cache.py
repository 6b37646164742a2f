"""``DCPStaticCache``: transformers' ``StaticCache`` for a DCP group, each rank holding
its shard of every layer's slots; and the refusals of layer types DCP does not shard."""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "dcp_compile.hf needs Hugging Face transformers 5.x: pip install 'dcp-compile[hf]'"
    ) from error

from dcp_compile.group import DCPGroup
from dcp_compile.layout import KVLayout
from dcp_compile.ops.guard import guard
from dcp_compile.records import CacheRecord, register

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


def _refuse_unshardable_layers(config) -> None:
    """Refuse layer types that are not full or sliding attention over a KV cache, with why."""
    unknown = sorted(set(_layer_types(config)) - set(_SUPPORTED_LAYERS))
    if unknown:
        why = "; ".join(f"{t}: {_WHY_NOT_SHARDED.get(t, 'not a full causal attention over a KV cache')}" for t in unknown)
        raise ValueError(
            f"DCPStaticCache shards the caches of full causal attention layers; {type(config).__name__} has layer "
            f"types {unknown} ({why}), which DCP does not shard"
        )


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
        _refuse_unshardable_layers(config)
        types = _layer_types(config)
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


def check_shardable(config) -> None:
    """Refuse, with the reason, a model whose attention DCP does not shard here: layer
    types other than full causal attention (sparse, linear, chunked, hybrid) and
    sliding windows.  Reads the config only."""
    config = _text_config(config)
    _refuse_unshardable_layers(config)
    _refuse_sliding(config)


def _refuse_sliding(config) -> None:
    types = _layer_types(config)
    if any(t != "full_attention" for t in types):
        raise ValueError(
            f"{type(config).__name__} uses sliding-window attention (layer_types {sorted(set(types))}, sliding_window="
            f"{getattr(config, 'sliding_window', None)}); DCPCausalLM builds a full causal mask and would drop the window. "
            f"DCP shards full causal attention only: set sliding_window=None (Mistral) or use_sliding_window=False (Qwen2) "
            f"if your contexts never exceed the window"
        )


def cache_kwarg(model) -> str:
    """The name the model's forward takes its cache by: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
