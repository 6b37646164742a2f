"""``compile_for_generate``: transformers' own ``model.generate()`` under DCP, one
prefill-chunk graph and one decode graph for every prompt width and batch.

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
"""

from __future__ import annotations

import torch
from torch import nn

from dcp_compile.group import DCPGroup
from dcp_compile.hf.cache import DCPStaticCache, cache_kwarg


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

    How (the module docstring says more): ``model.forward`` compiled with
    ``fullgraph=True, dynamic=False``; the prompt prefilled in chunks of ``chunk_size``
    (``None``: ``DEFAULT_CHUNK_SIZE``); a batch of fewer rows padded to the cache's; a
    left-padding mask carried as each row's bound; and, with ``max_batch_size`` and
    ``max_cache_len`` (both or neither), a ``DCPStaticCache`` that ``generate`` uses when
    it is called without one (``model.dcp_cache``).

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
        positions = model_kwargs.get("position_ids")
        _check_prefill(input_ids, generation_config, model_kwargs, cache, positions, state)
        if state.fresh:
            cache.reset()
        past = int(cache.get_seq_length())
        batch, width = input_ids.shape
        if past >= width:
            raise ValueError(
                f"the DCPStaticCache already holds {past} tokens, and the prompt brings {width}: a prompt continues "
                f"what the cache holds, so it must be longer; call cache.reset() between requests"
            )
        state.lower = left_padding_bound(model_kwargs.get("attention_mask"), batch, width, cache.store.k_0.shape[0],
                                         cache.max_cache_len, device=input_ids.device)
        return _run_chunks(model, state, cache, input_ids, positions, past, model_kwargs, is_first_iteration)

    return prefill


def _check_prefill(input_ids, generation_config, model_kwargs, cache, positions, state: _GenerateState) -> None:
    """What the prefill refuses before anything is written: a cache other than a
    ``DCPStaticCache``, embeddings for ids, and a request the cache cannot hold."""
    if not isinstance(cache, DCPStaticCache):
        raise ValueError(
            f"generate() under DCP prefills a DCPStaticCache, got {type(cache).__name__}: pass "
            f"{state.cache_kwarg}=DCPStaticCache(...), or size one with compile_for_generate(..., "
            f"max_batch_size=..., max_cache_len=...)"
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("generate() under DCP prefills input_ids, not inputs_embeds: pass the token ids")
    batch, width = input_ids.shape
    capacity = cache.max_cache_len
    _check_request(input_ids, model_kwargs.get("attention_mask"), cache.store.k_0.shape[0], capacity,
                   cache.store.k_0.device)
    if generation_config.max_length > capacity:
        raise ValueError(
            f"the prompt of {width} tokens plus the new ones make max_length={generation_config.max_length}, past "
            f"the cache's max_cache_len={capacity}: ask for at most {capacity - width} new tokens, or build the "
            f"cache with max_cache_len >= {generation_config.max_length}"
        )
    if positions is not None and positions.shape != (batch, width):
        raise ValueError(f"generate() under DCP takes position_ids [batch, tokens] = {[batch, width]}, got "
                         f"{list(positions.shape)}")


def _run_chunks(model, state: _GenerateState, cache, input_ids, positions, past: int, model_kwargs,
                is_first_iteration):
    """The prompt's tokens from ``past`` on through the compiled forward, ``C`` at a time
    (``_prefill_in_chunks``): the outputs of the last chunk, its logits cut to each row's
    last prompt token."""
    batch, width = input_ids.shape
    capacity = cache.max_cache_len
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
