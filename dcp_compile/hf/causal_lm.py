"""``DCPCausalLM``: a transformers causal LM as ``forward(tokens, positions)``, the
target interface of ``SpecDecoder``; and loading one from a directory."""

from __future__ import annotations

import torch
from torch import nn

from dcp_compile.hf.cache import DCPStaticCache, _head_dim, _refuse_sliding, _text_config, cache_kwarg, check_shardable
from dcp_compile.models.eagle import DraftConfig
from dcp_compile.models.llama import LlamaConfig


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


class DCPCausalLM(nn.Module):
    """An HF causal LM as ``forward(tokens [B, T], positions [B, T]) -> logits [B, T, V]``
    (fp32), or ``(logits, features [B, T, len(aux_layers) * hidden])`` with ``aux_layers``.

    It is a ``SpecDecoder`` target (``vocab_size``, ``feature_width``);
    ``EagleDraft(wrapper.draft_config("eagle3"))`` builds a draft sized for it.
    """

    def __init__(self, model: nn.Module, *, max_batch: int, max_seq_len: int, aux_layers: tuple[int, ...] = (),
                 cache_device=None):
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
        # cache_device="meta": the caches are left for dcp.prepare to allocate, so that a
        # paged target's max_batch x max_seq_len rows never exist whole.
        self.cache = DCPStaticCache(config, None, max_batch_size=max_batch, max_cache_len=max_seq_len, dtype=param.dtype,
                                    device=param.device if cache_device is None else cache_device)
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
