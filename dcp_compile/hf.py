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
    transformers 5.24 on, as ``past_key_values`` before.

    After ``compile_for_generate`` a left-padded mask does not go in as this table but as
    each row's bound (``left_padding_bound``), which runs the length-bounded kernels;
    the table serves the other masks.  A batch of fewer rows than the cache passes here
    as it is: the compiled forward pads it to the cache's rows."""
    from transformers.masking_utils import create_masks_for_generate

    cache = cache if cache is not None else past_key_values
    if not isinstance(cache, DCPStaticCache):
        return create_masks_for_generate(config, inputs_embeds, attention_mask, cache, position_ids, **kwargs)
    rows = cache.store.k_0.shape[0]
    if inputs_embeds.shape[0] > rows:
        raise ValueError(
            f"generate() runs a batch of {inputs_embeds.shape[0]} rows, but the DCPStaticCache holds {rows}: "
            f"num_return_sequences multiplies the rows (beam search is not supported under DCP). Build the cache with "
            f"max_batch_size={inputs_embeds.shape[0]} (compile_for_generate(..., max_batch_size=...)), or pass fewer "
            f"prompts"
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


def compile_for_generate(
    model: nn.Module,
    group: DCPGroup,
    *,
    chunk_size: int | None = None,
    max_batch_size: int | None = None,
    max_cache_len: int | None = None,
    **backend_options,
):
    """Make transformers' own ``model.generate()`` run under DCP as a serving loop calls
    it: any prompt width and any batch up to the cache's rows, through one prefill-chunk
    graph and one decode graph for as long as the model serves.

    - ``model.forward`` is compiled by ``dcp.backend(group, **backend_options)`` with
      ``fullgraph=True, dynamic=False``, so the prefill and every decode step run
      through the passes (transformers' own auto-compile compiles only the decode, with
      its own backend; it is switched off here).
    - The prompt is prefilled in chunks of ``chunk_size`` tokens, every chunk one static
      shape whatever the prompt's width (``runtime.generate.prefill_chunks`` does the same
      for ``SpecDecoder``); their last logits feed ``generate``'s own loop, so logits
      processors, stopping criteria, ``eos_token_id``, seeded sampling and ``streamer=``
      work as they do in transformers.  ``None``: ``DEFAULT_CHUNK_SIZE``; a cache shorter
      than the chunk takes chunks of its own capacity.
    - A batch of fewer rows than the cache holds is padded with rows that see nothing, so
      the graphs keep the cache's batch.
    - A left-padded attention mask (every row's pads first; no mask is the unpadded case)
      enters the graph as each row's first visible position (``left_padding_bound``),
      from which the compiled forward builds ``slots >= bound[b]`` itself: a form the
      passes prove, so padded sites run the same length-bounded kernels as unpadded ones
      (Triton on CUDA).  Any other 2-D mask enters as it is and runs the masked reference
      attention (two more graphs, compiled at its first use).
    - ``max_batch_size`` and ``max_cache_len`` (both or neither) size a ``DCPStaticCache``
      that ``generate`` uses, reset per call, when it is called without one
      (``model.dcp_cache``).  A cache passed in (``cache=`` from transformers 5.24 on,
      ``past_key_values=`` before: ``cache_kwarg(model)``) is used as transformers uses
      it: reset it between requests.

    Refused before anything is written, each with what was expected, what was found and
    the fix: beam search, assisted generation, prompt lookup and contrastive search
    (they move or crop the cache's rows); no cache on a model compiled without a size
    for one, or a cache that is not a ``DCPStaticCache`` (transformers' own caches are
    not sharded); a batch of more rows than the cache; an ``attention_mask`` of another
    shape than the ids; a prompt plus ``max_new_tokens`` longer than the cache.  The
    model is changed in place; returns the backend (its compiled graphs and collective
    counts).
    """
    import inspect

    from dcp_compile.backend import backend
    from dcp_compile.runtime.generate import DEFAULT_CHUNK_SIZE, check_chunk_size

    if (max_batch_size is None) != (max_cache_len is None):
        raise ValueError(
            f"compile_for_generate sizes the cache generate() uses from max_batch_size and max_cache_len together; got "
            f"max_batch_size={max_batch_size}, max_cache_len={max_cache_len}: give both, or neither and pass a "
            f"DCPStaticCache to every generate() call"
        )
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    check_chunk_size(chunk_size, chunk_size)  # a cache shorter than the chunk takes chunks of its capacity
    cache = None
    if max_batch_size is not None:
        param = next(model.parameters())
        cache = DCPStaticCache(model.config, group, max_batch_size=max_batch_size, max_cache_len=max_cache_len,
                               dtype=param.dtype, device=param.device)
    forward = model.forward
    state = _GenerateState(cache_kwarg(model), chunk_size, cache,
                           "logits_to_keep" in inspect.signature(forward).parameters)
    dcp_backend = backend(group, **backend_options)
    compiled = torch.compile(_masked_from_bound(forward, state.cache_kwarg), backend=dcp_backend, fullgraph=True,
                             dynamic=False)
    model.forward = _rows_padded(compiled, forward, state)
    model.create_masks_for_generate = static_width_masks
    model.generation_config.disable_compile = True
    model._prefill = _prefill_in_chunks(model, state)
    model.generate = _refusing_unsupported_modes(model.generate, model, state)
    model.dcp_cache = cache
    return dcp_backend


class _GenerateState:
    """What ``compile_for_generate`` binds into the model's ``generate``, ``_prefill``
    and ``forward``."""

    def __init__(self, cache_kwarg: str, chunk_size: int, cache: DCPStaticCache | None, keeps_logits: bool):
        self.cache_kwarg = cache_kwarg
        """The keyword the model's forward takes its cache by (``cache_kwarg``)."""
        self.chunk_size = chunk_size
        self.cache = cache
        """The cache ``generate`` uses when called without one; None: it must be passed."""
        self.keeps_logits = keeps_logits
        """Whether the forward takes ``logits_to_keep`` (a prefill chunk needs one row's)."""
        self.lower: torch.Tensor | None = None
        """The running ``generate`` call's left-padding bound, one per cache row (set by
        its prefill; None outside a call, or for a mask that is not left-padded)."""
        self.fresh = False
        """Whether the running call uses ``cache``, which its prefill resets once the
        request is checked."""


def left_padding_bound(attention_mask: torch.Tensor | None, batch: int, width: int, rows: int,
                       max_cache_len: int, device=None) -> torch.Tensor | None:
    """``[rows]`` int64: each row's first visible position when ``attention_mask [batch,
    width]`` is left-padded (every row ``0 ... 0 1 ... 1``, or all zeros), None for any
    other mask.  No mask: 0 for every row.  Rows past ``batch`` (the padding of a short
    batch) get ``max_cache_len``: they see nothing.  Reads one bool back to the host,
    once per ``generate`` call.  ``device``: the bound's without a mask (the mask's with one)."""
    if attention_mask is None:
        first = torch.zeros(batch, dtype=torch.long, device=device)
    else:
        keep = attention_mask != 0
        positions = torch.arange(width, device=attention_mask.device)
        first = torch.where(keep.any(1), keep.int().argmax(1), width)  # argmax: the first of the maxima
        if not torch.equal(keep, positions[None, :] >= first[:, None]):
            return None
    return torch.cat([first, first.new_full((rows - batch,), max_cache_len)])


def _masked_from_bound(forward, cache_kwarg: str):
    """The function ``compile_for_generate`` compiles: ``forward``, whose 2-D attention
    mask, where ``key_lower_bound [B]`` is given, the graph builds itself as
    ``slots >= key_lower_bound[b]`` over the cache's global positions."""

    def forward_from_bound(*args, key_lower_bound: torch.Tensor | None = None, **kwargs):
        if key_lower_bound is not None:
            slots = torch.arange(kwargs[cache_kwarg].max_cache_len, device=key_lower_bound.device)
            kwargs["attention_mask"] = slots[None, :] >= key_lower_bound[:, None]
        return forward(*args, **kwargs)

    return forward_from_bound


_ROW_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "attention_mask", "token_type_ids")
"""Forward inputs with one row per sequence, padded to the cache's rows (with zeros:
pad tokens, and a mask under which the padding rows see nothing)."""


def _rows_padded(compiled, forward, state: _GenerateState):
    """``model.forward`` after ``compile_for_generate``: a call with a ``DCPStaticCache``
    of more rows than the batch runs the compiled graph on the batch padded to the
    cache's rows and returns the batch's own rows; inside ``generate`` a left-padding
    bound replaces the mask."""
    import functools

    @functools.wraps(forward)
    def padded(*args, **kwargs):
        cache = kwargs.get(state.cache_kwarg)
        first = kwargs.get("input_ids")
        first = kwargs.get("inputs_embeds") if first is None else first
        if args or not isinstance(cache, DCPStaticCache) or first is None:
            return compiled(*args, **kwargs)  # the backend refuses what it must
        rows, batch = cache.store.k_0.shape[0], first.shape[0]
        if batch > rows:
            raise ValueError(
                f"a batch of {batch} rows, but the DCPStaticCache holds {rows}: split the batch, or build the cache "
                f"with max_batch_size={batch} (compile_for_generate(..., max_batch_size={batch}))"
            )
        if state.lower is not None:
            kwargs.pop("attention_mask", None)
            kwargs["key_lower_bound"] = state.lower
        if batch < rows:
            for name in _ROW_INPUTS:
                x = kwargs.get(name)
                if isinstance(x, torch.Tensor):
                    kwargs[name] = torch.cat([x, x.new_zeros((rows - batch, *x.shape[1:]))])
        out = compiled(**kwargs)
        if batch < rows:
            for name in ("logits", "hidden_states"):
                value = out.get(name)
                if isinstance(value, torch.Tensor):
                    out[name] = value[:batch]
                elif isinstance(value, tuple):
                    out[name] = tuple(v[:batch] for v in value)
        return out

    return padded


def _prefill_in_chunks(model: nn.Module, state: _GenerateState):
    """``generate``'s prefill step (``GenerationMixin._prefill``, the same in transformers
    5.17 and 5.24) in chunks of one shape.

    Chunk ``c`` holds positions ``past + c * C ...`` of every row (``past``: what the cache
    already holds); the last chunk is filled past the prompt with pad tokens at the
    positions after it, which the causal mask hides from every prompt token and the
    decode steps overwrite before any query reaches them.  Where that would run past
    the cache, the last chunk starts earlier instead and writes again, with the same
    prefix, the slots the chunk before it wrote.  Afterwards the cache's length is the
    prompt's width, and the outputs hold the logits of each row's last prompt token."""

    def prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True):
        cache = model_kwargs.get(state.cache_kwarg)
        if not isinstance(cache, DCPStaticCache):
            raise ValueError(
                f"generate() under DCP prefills a DCPStaticCache, got {type(cache).__name__}: pass "
                f"{state.cache_kwarg}=DCPStaticCache(...), or size one with compile_for_generate(..., "
                f"max_batch_size=..., max_cache_len=...)"
            )
        if model_kwargs.get("inputs_embeds") is not None:
            raise ValueError("generate() under DCP prefills input_ids, not inputs_embeds: pass the token ids")
        batch, width = input_ids.shape
        rows, capacity = cache.store.k_0.shape[0], cache.max_cache_len
        mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
        _check_request(input_ids, mask, rows, capacity, cache.store.k_0.device)
        if generation_config.max_length > capacity:
            raise ValueError(
                f"the prompt of {width} tokens plus the new ones make max_length={generation_config.max_length}, past "
                f"the cache's max_cache_len={capacity}: ask for at most {capacity - width} new tokens, or build the "
                f"cache with max_cache_len >= {generation_config.max_length}"
            )
        if positions is not None and positions.shape != (batch, width):
            raise ValueError(f"generate() under DCP takes position_ids [batch, tokens] = {[batch, width]}, got "
                             f"{list(positions.shape)}")
        if state.fresh:
            cache.reset()
        past = int(cache.get_seq_length())
        if past >= width:
            raise ValueError(
                f"the DCPStaticCache already holds {past} tokens, and the prompt brings {width}: a prompt continues "
                f"what the cache holds, so it must be longer; call cache.reset() between requests"
            )
        state.lower = left_padding_bound(mask, batch, width, rows, capacity, device=input_ids.device)
        C = min(state.chunk_size, capacity)
        steps = torch.arange(1, C + 1, device=input_ids.device)
        ids = torch.cat([input_ids, input_ids.new_zeros((batch, C))], dim=1)
        if positions is not None:
            positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
        for start in range(past, width, C):
            start = min(start, capacity - C)
            last = min(width - 1 - start, C - 1)  # the chunk index of the prompt's last token
            cache.length.fill_(start)
            kwargs = dict(model_kwargs)
            if positions is not None:
                kwargs["position_ids"] = positions[:, start : start + C].contiguous()
            if state.keeps_logits:
                kwargs["logits_to_keep"] = torch.full((1,), last, device=input_ids.device)
            inputs = model.prepare_inputs_for_generation(ids[:, start : start + C].contiguous(),
                                                         is_first_iteration=is_first_iteration, **kwargs)
            outputs = model(**inputs, return_dict=True)
        cache.length.fill_(width)
        if not state.keeps_logits:
            outputs["logits"] = outputs.logits[:, last : last + 1]
        return outputs

    return prefill


def _check_request(ids: torch.Tensor, attention_mask, rows: int, capacity: int, device: torch.device) -> None:
    """What a ``generate`` call must satisfy before anything is written."""
    batch, width = ids.shape
    for name, tensor in (("input_ids", ids), ("attention_mask", attention_mask)):
        if isinstance(tensor, torch.Tensor) and tensor.device != device:
            raise ValueError(
                f"generate() under DCP takes {name} on the model's device ({device}), got it on {tensor.device}: "
                f"the compiled graphs are fixed to their device. Move the inputs with .to(model.device)"
            )
    if batch > rows:
        raise ValueError(
            f"generate() got a batch of {batch} rows (num_return_sequences multiplies them), but the DCPStaticCache "
            f"holds {rows}: split the batch, or build the cache with max_batch_size={batch} "
            f"(compile_for_generate(..., max_batch_size={batch}))"
        )
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, width):
        raise ValueError(
            f"attention_mask must be [batch, tokens] = {[batch, width]}, like the input ids, got "
            f"{list(attention_mask.shape)}: one mask entry per prompt token (1 for a token, 0 for padding)"
        )
    if width > capacity:
        raise ValueError(
            f"a prompt of {width} tokens does not fit the DCPStaticCache's max_cache_len={capacity}: build it larger "
            f"(compile_for_generate(..., max_cache_len=...)), or shorten the prompt"
        )


_UNSUPPORTED_MODES = (
    ("num_beams", lambda v: v is not None and v > 1, "beam search (num_beams > 1) reorders the cache's rows"),
    ("assistant_model", lambda v: v is not None, "assisted generation crops the cache"),
    ("prompt_lookup_num_tokens", lambda v: v is not None, "prompt-lookup decoding crops the cache"),
    ("penalty_alpha", lambda v: v is not None and v > 0, "contrastive search selects cache rows"),
    ("use_cache", lambda v: v is False, "without the cache every step recomputes the whole sequence"),
)


def _refusing_unsupported_modes(generate, model, state: _GenerateState):
    """``generate`` that refuses, before the prefill writes anything, the modes that move
    or crop the cache's rows (they would need the cache whole), a cache other than a
    ``DCPStaticCache``, and a request the cache cannot hold; and gives a call without a
    cache the one ``compile_for_generate`` sized, reset."""
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
        passed = [name for name in ("cache", "past_key_values") if kwargs.get(name) is not None]
        if passed:
            cache = kwargs[passed[0]]
            if not isinstance(cache, DCPStaticCache):
                raise ValueError(
                    f"generate() under DCP takes a DCPStaticCache, got {passed[0]}={type(cache).__name__}: "
                    f"transformers' caches hold whole tensors, which DCP does not shard. Pass {state.cache_kwarg}="
                    f"DCPStaticCache(model.config, group, max_batch_size=..., max_cache_len=...), or no cache after "
                    f"compile_for_generate(model, group, max_batch_size=..., max_cache_len=...)"
                )
        elif state.cache is None:
            raise ValueError(
                f"generate() was called without a cache, and compile_for_generate was not given the size of one: "
                f"transformers would build a DynamicCache, which DCP does not shard. Call "
                f"compile_for_generate(model, group, max_batch_size=B, max_cache_len=S), or pass "
                f"{state.cache_kwarg}=DCPStaticCache(model.config, group, max_batch_size=B, max_cache_len=S)"
            )
        else:
            cache = state.cache
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            _check_request(ids, kwargs.get("attention_mask"), cache.store.k_0.shape[0], cache.max_cache_len,
                           cache.store.k_0.device)
        if not passed:
            kwargs[state.cache_kwarg] = cache
        state.lower, state.fresh = None, not passed
        try:
            return generate(*args, **kwargs)
        finally:
            state.lower, state.fresh = None, False

    return checked


def check_shardable(config) -> None:
    """Refuse, with the reason, a model whose attention DCP does not shard here: layer
    types other than full causal attention (sparse, linear, chunked, hybrid) and
    sliding windows.  Reads the config only."""
    config = _text_config(config)
    _refuse_unshardable_layers(config)
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
    "left_padding_bound", "load_causal_lm", "static_width_masks", "transformers",
]
