"""Published EAGLE3 and EAGLE-1 draft checkpoints, read into ``EagleDraft``.

The layouts are the ones SafeAILab's EAGLE, SpecForge, SGLang and vLLM write and read
(``EAGLE_FORMATS.md`` in the design notes):

- **EAGLE3**: ``midlayer.*`` (one decoder layer over ``cat(norm(embed), norm(hidden))``),
  ``fc`` (no bias), ``norm``, ``lm_head`` over a draft vocabulary, ``d2t`` (target id =
  draft id + d2t[draft id]), often no ``embed_tokens`` (the target's is used);
- **EAGLE-1** (and EAGLE-2): ``layers.0.*`` with no input norm, ``fc`` over
  ``cat(embed, feature)`` with a bias unless the config says ``"bias": false``, no final
  norm, and the target's LM head.

Both are detected by their weight names (``architectures`` differs between the sources).
The weights are in Hugging Face's rotate-half RoPE layout; the model here rotates
interleaved pairs, so the q and k rows are permuted per head on the way in (the scores
are unchanged: queries and keys are permuted alike).

Which target layers feed an EAGLE3 draft: the inputs of layers ``2, L//2, L-3`` by
default; a config may name them, and the sources disagree on what a number means: a
top-level ``eagle_aux_hidden_state_layer_ids`` is a layer's *input* (vLLM), one under
``eagle_config`` is a layer's *output* (SGLang, SpecForge), i.e. the input of the next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from dcp_compile.files import read_json_object
from dcp_compile.models.draft_config import DraftConfig, TargetShape, eagle3_aux_layers
from dcp_compile.models.llama import LlamaConfig, RopeScaling
from dcp_compile.models.rope_layout import rotate_half_to_interleaved

EAGLE3, EAGLE1 = "eagle3", "eagle"

# Published names (without a "model." prefix) -> EagleDraft's.
LAYER_NAMES = MappingProxyType({
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
})
"""One decoder layer's weights, Hugging Face's names -> this package's (under the layer's prefix)."""
EAGLE3_NAMES = MappingProxyType({
    **{f"midlayer.{k}": v for k, v in LAYER_NAMES.items()},
    "midlayer.input_layernorm.weight": "embed_norm.weight",
    "midlayer.hidden_norm.weight": "hidden_norm.weight",
    "fc.weight": "fc.weight",
    "fc.bias": "fc.bias",
    "norm.weight": "norm.weight",
    "lm_head.weight": "head.weight",
    "d2t": "d2t",
    "embed_tokens.weight": "embed.weight",
})
EAGLE1_NAMES = MappingProxyType({
    **{f"layers.0.{k}": v for k, v in LAYER_NAMES.items()},
    "fc.weight": "fc.weight",
    "fc.bias": "fc.bias",
    "embed_tokens.weight": "embed.weight",
})
_IGNORED = frozenset({"t2d"})
"""Read by training only: True at the target ids the draft vocabulary covers."""

_REFUSED_FLAGS = MappingProxyType({
    "fc_norm": "a per-feature RMSNorm before fc (SpecForge's fc_norm)",
    "norm_before_residual": "the residual taken after hidden_norm (vLLM's norm_before_residual)",
    "norm_before_fc": "an RMSNorm before fc (norm_before_fc)",
    "norm_output": "a normed output hidden state fed to the next step (SpecForge's norm_output)",
    "qkv_bias": "biases on q_proj, k_proj and v_proj",
})
"""Config switches that change the computation, which the draft here does not compute."""

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def weight_files(directory: Path, what: str = "draft") -> list[Path]:
    """The checkpoint's weight files: one file, or the shards its index lists."""
    directory = Path(directory)
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return [directory / name]
        index = directory / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [s for s in shards if not (directory / s).is_file()]
            if missing:
                raise FileNotFoundError(f"{index} lists shards that are missing from {directory}: {missing}")
            return [directory / s for s in shards]
    raise FileNotFoundError(
        f"no weights in the {what} directory {directory}: expected {' or '.join(WEIGHT_FILES)} (or a sharded "
        f"*.index.json beside its shards), found {sorted(p.name for p in directory.iterdir())[:12]}"
    )


def read_config(directory) -> dict:
    """The draft's config.json, checked to be there and to be an object."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no draft checkpoint directory at {str(directory)!r}")
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a draft checkpoint holds config.json beside its weights")
    config = read_json_object(path)
    weight_files(directory)
    return config


def _weight_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for path in files:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        else:
            shapes.update({k: tuple(v.shape) for k, v in torch.load(path, map_location="meta",
                                                                      weights_only=True).items()})
    return shapes


def _read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    state = {}
    for path in files:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(path)))
        else:
            state.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    return state


def _strip_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


@dataclass(frozen=True)
class DraftCheckpoint:
    """A draft checkpoint's config and weight names, checked; no tensor read yet."""

    directory: Path
    kind: str
    config: dict
    shapes: dict[str, tuple[int, ...]]
    """The published weights' shapes, by name without a ``model.`` prefix."""


def inspect(directory) -> DraftCheckpoint:
    """The checkpoint's layout (EAGLE3 or EAGLE-1), from its weight names; refuses the
    layouts and extensions that ``EagleDraft`` does not compute, naming them."""
    directory = Path(directory)
    config = read_config(directory)
    shapes = {_strip_prefix(k): v for k, v in _weight_shapes(weight_files(directory)).items()}
    names = tuple(shapes)
    if any(n.startswith("midlayer.") for n in names):
        kind, known = EAGLE3, EAGLE3_NAMES
    elif any(n.startswith("layers.0.") for n in names):
        kind, known = EAGLE1, EAGLE1_NAMES
    else:
        raise ValueError(
            f"{directory} is not an EAGLE draft checkpoint: expected EAGLE3 weights (midlayer.*, fc, lm_head) or "
            f"EAGLE-1 weights (layers.0.*, fc), found {sorted(names)[:8]}"
        )
    flags = {**config, **(config.get("eagle_config") or {})}
    refused = [f"{key} ({why})" for key, why in _REFUSED_FLAGS.items() if flags.get(key)]
    refused += ["fc_norm weights (a per-feature RMSNorm before fc)"] * any(n.startswith("fc_norm.") for n in names)
    layers = config.get("num_hidden_layers", 1)
    extra_layers = sorted({n.split(".")[1] for n in names if n.startswith("layers.") and n.split(".")[1] != "0"})
    if layers != 1 or extra_layers:
        refused.append(f"more than one draft layer (num_hidden_layers={layers}, layers {extra_layers})")
    if config.get("hidden_act", "silu") != "silu":
        refused.append(f"hidden_act={config['hidden_act']!r} (the MLP here is SwiGLU with silu)")
    if kind == EAGLE3 and config.get("tie_word_embeddings"):
        refused.append("tie_word_embeddings (an LM head tied to the draft's embedding)")
    if refused:
        raise ValueError(
            f"the {kind.upper()} draft in {directory} uses what this package does not compute: {'; '.join(refused)}. "
            f"Use a draft without these extensions"
        )
    unknown = sorted(set(names) - set(known) - _IGNORED)
    if unknown:
        raise ValueError(
            f"the {kind.upper()} draft in {directory} has weights this package does not compute: {unknown[:8]}; "
            f"expected only {sorted(known)}"
        )
    return DraftCheckpoint(directory, kind, config, shapes)


def feature_layers(directory, n_layers) -> tuple[int, ...]:
    """The target layers whose hidden states the draft reads, as ``aux_layers`` (the input
    of each layer; ``n_layers``: the final normed hidden state).  ``n_layers`` is the
    target's depth, or an HF config (its ``num_hidden_layers``)."""
    if not isinstance(n_layers, int):
        n_layers = n_layers.num_hidden_layers
    return _feature_layers(inspect(directory), n_layers)


def _feature_layers(ckpt: DraftCheckpoint, n_layers: int) -> tuple[int, ...]:
    directory = ckpt.directory
    if ckpt.kind == EAGLE1:
        return (n_layers,)
    config = ckpt.config
    inputs = config.get("eagle_aux_hidden_state_layer_ids")
    outputs = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if outputs is not None:
        as_inputs = [i + 1 for i in outputs]
        if inputs is not None and list(inputs) != as_inputs:
            raise ValueError(
                f"{directory / 'config.json'} names the feature layers twice and the two disagree: top-level "
                f"eagle_aux_hidden_state_layer_ids {inputs} (layer inputs, as vLLM reads it) and "
                f"eagle_config.eagle_aux_hidden_state_layer_ids {outputs} (layer outputs, as SGLang reads it: inputs "
                f"{as_inputs}); keep the one the draft was trained with"
            )
        inputs = as_inputs
    if inputs is None:
        return eagle3_aux_layers(n_layers)
    layers = tuple(int(i) for i in inputs)
    if list(layers) != sorted(set(layers)) or not all(0 <= i < n_layers for i in layers):
        raise ValueError(
            f"{directory / 'config.json'} names the feature layers {layers} (as layer inputs); this package reads "
            f"increasing layer inputs in [0, {n_layers}) of a {n_layers}-layer target"
        )
    return layers


def rope_of(config: dict, where: Path) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` of a config in the legacy (``rope_theta``,
    ``rope_scaling``) or transformers-5 (``rope_parameters``) form; theta 10000 when
    absent, as the published drafts' own code assumes."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {}) or params
    theta = float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in RopeScaling.TYPES:
        raise ValueError(
            f"{where / 'config.json'} asks for RoPE scaling of type {kind!r}, which this package does not implement "
            f"(implemented: default, {', '.join(RopeScaling.TYPES)})"
        )
    fields = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                       "original_max_position_embeddings") if k in scaling}
    if "factor" not in fields:
        raise ValueError(f"{where / 'config.json'}: RoPE scaling {kind!r} needs a 'factor', got {scaling}")
    return theta, RopeScaling(kind, **fields)


def layer_config(ckpt: DraftCheckpoint, *, vocab_size: int, max_batch: int, max_seq_len: int) -> LlamaConfig:
    """The draft layer's own shapes and RoPE from its config.json."""
    config, where = ckpt.config, ckpt.directory
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        theta, scaling = rope_of(config, where)
        return LlamaConfig(
            vocab_size=vocab_size, dim=dim, n_layers=1, n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads") or heads),
            intermediate_size=int(config["intermediate_size"]), max_seq_len=max_seq_len, max_batch=max_batch,
            rope_theta=theta, rope_scaling=scaling, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            head_dim=int(config.get("head_dim") or dim // heads),
        )
    except KeyError as err:
        raise ValueError(f"{where / 'config.json'} lacks {err}, which a draft's config must give") from err


def _target_shape(target) -> TargetShape:
    max_batch, max_seq_len = target.cache_shape
    return TargetShape(vocab_size=target.vocab_size, dim=target.hidden_size, n_layers=target.num_layers,
                       aux_layers=tuple(target.aux_layers), max_batch=max_batch, max_seq_len=max_seq_len)


def draft_config(ckpt: DraftCheckpoint, target, state_shapes: dict[str, tuple[int, ...]]):
    """The ``DraftConfig`` of a checkpoint for ``target`` (a ``DraftHost``), with every
    width the weights have checked against the config and the target."""
    shape = _target_shape(target)
    where = ckpt.directory
    expected_layers = _feature_layers(ckpt, shape.n_layers)
    if shape.aux_layers != expected_layers:
        raise ValueError(
            f"the draft in {where} reads the target's hidden states at layers {expected_layers} (layer inputs; "
            f"{shape.n_layers}: the final normed state), but the target returns {shape.aux_layers}: build the target "
            f"with aux_layers=feature_layers({str(where)!r}, {shape.n_layers})"
        )
    layer = layer_config(ckpt, vocab_size=shape.vocab_size, max_batch=shape.max_batch, max_seq_len=shape.max_seq_len)
    config = ckpt.config
    target_width = int(config.get("target_hidden_size") or shape.dim)
    if target_width != shape.dim:
        raise ValueError(
            f"the draft in {where} was trained on a target {target_width} wide (target_hidden_size), but this "
            f"target is {shape.dim} wide"
        )
    vocab = int(config.get("vocab_size", shape.vocab_size))
    if vocab != shape.vocab_size:
        raise ValueError(
            f"the draft in {where} is for a target vocabulary of {vocab} tokens (vocab_size), but this target has "
            f"{shape.vocab_size}"
        )
    fc_in = state_shapes["fc.weight"][1]
    if ckpt.kind == EAGLE3:
        # SGLang builds fc from the config's "bias", the others never give it one: the
        # weight itself says which.
        bias = "fc.bias" in state_shapes
        n_features = len(expected_layers)
        draft_vocab = state_shapes.get("head.weight", (None,))[0]
        if draft_vocab is None:
            raise ValueError(f"the EAGLE3 draft in {where} has no lm_head.weight")
        if config.get("draft_vocab_size") not in (None, draft_vocab):
            raise ValueError(f"{where}: draft_vocab_size {config['draft_vocab_size']} but lm_head has {draft_vocab} rows")
        expected_in = n_features * shape.dim
        cfg = DraftConfig(shape, EAGLE3, n_features=n_features, layer=layer, fc_bias=bias,
                          draft_vocab_size=None if draft_vocab == shape.vocab_size else draft_vocab)
    else:
        bias = bool(config.get("bias", True))
        expected_in = layer.dim + shape.dim
        cfg = DraftConfig(shape, EAGLE1, layer=layer, fc_bias=bias)
    if fc_in != expected_in:
        raise ValueError(
            f"the draft's fc in {where} reads features {fc_in} wide, but this target gives {expected_in} "
            f"({'%d features x %d' % (len(expected_layers), shape.dim) if ckpt.kind == EAGLE3 else 'embedding + final hidden state'}): "
            f"the draft was trained for another target"
        )
    return cfg


def _read_d2t(files: list[Path]) -> torch.Tensor | None:
    for path in files:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if _strip_prefix(key) == "d2t":
                        return f.get_tensor(key)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for key, value in state.items():
                if _strip_prefix(key) == "d2t":
                    return value
    return None


@dataclass(frozen=True)
class DraftPlan:
    """A checkpoint checked against a target from its config and weight shapes alone."""

    ckpt: DraftCheckpoint
    cfg: object
    """The ``DraftConfig``."""
    names: dict[str, str]
    """Published weight names -> ``EagleDraft``'s."""
    shared: tuple[str, ...]
    """``EagleDraft`` parameters that are the target's (``embed.weight``, EAGLE-1's ``head.weight``)."""


def check(directory, target, draft_class) -> DraftPlan:
    """Every check ``from_pretrained`` makes, from the configs and the weight shapes (and
    the small ``d2t``), without reading the weights: so that a command refuses a draft
    for another target before any rank starts.  ``target`` is a ``DraftHost`` or anything
    with its shape attributes.  ``draft_class``: the model the weights are for
    (``EagleDraft``), passed in since its ``from_pretrained`` calls this module."""
    ckpt = inspect(directory)
    names = EAGLE3_NAMES if ckpt.kind == EAGLE3 else EAGLE1_NAMES
    files = weight_files(ckpt.directory)
    shapes = {names[k]: v for k, v in ckpt.shapes.items() if k not in _IGNORED}
    published = {v: k for k, v in names.items()}
    if "fc.weight" not in shapes:
        raise ValueError(f"the {ckpt.kind.upper()} draft in {ckpt.directory} lacks fc.weight")
    cfg = draft_config(ckpt, target, shapes)
    if ckpt.kind == EAGLE3 and "d2t" not in shapes and cfg.draft_vocab_size is not None:
        raise ValueError(
            f"the EAGLE3 draft in {ckpt.directory} has a vocabulary of {cfg.draft_vocab_size} tokens but no d2t map "
            f"to the target's {cfg.target.vocab_size}"
        )
    if "d2t" in shapes:
        d2t = _read_d2t(files)
        target_ids = torch.arange(len(d2t)) + d2t.long()
        outside = int(((target_ids < 0) | (target_ids >= cfg.target.vocab_size)).sum())
        if outside:
            raise ValueError(
                f"the draft's d2t in {ckpt.directory} maps {outside} of its {len(target_ids)} tokens outside the "
                f"target vocabulary [0, {cfg.target.vocab_size}) (largest id {int(target_ids.max())}): the draft was "
                f"trained for another tokenizer"
            )
    # A checkpoint without embed_tokens takes the target's; EAGLE-1 always takes its head.
    shared = ("embed.weight",) * ("embed.weight" not in shapes) + ("head.weight",) * (ckpt.kind == EAGLE1)
    wanted = {k: tuple(v.shape) for k, v in draft_class(cfg, device="meta", cache_device="meta").state_dict().items()}
    if "embed.weight" in shared and wanted["embed.weight"] != (target.vocab_size, target.hidden_size):
        raise ValueError(
            f"the draft in {ckpt.directory} has no embed_tokens and so takes the target's, which is "
            f"{(target.vocab_size, target.hidden_size)}, but the draft is {wanted['embed.weight'][1]} wide"
        )
    missing = sorted(set(wanted) - set(shapes) - set(shared) - {"d2t"})
    if missing:
        raise ValueError(
            f"the {ckpt.kind.upper()} draft in {ckpt.directory} lacks {[published.get(m, m) for m in missing]}"
            + (" (its config.json says fc has a bias, as EAGLE-1's does unless \"bias\": false)"
               if missing == ["fc.bias"] else "")
        )
    for name, shape in shapes.items():
        if shape != wanted[name]:
            raise ValueError(
                f"the draft's {published.get(name, name)} in {ckpt.directory} is {shape}, but its config.json gives "
                f"{wanted[name]}"
            )
    return DraftPlan(ckpt, cfg, names, shared)


def load_draft(cls, directory, target, *, dtype: torch.dtype, device):
    """``EagleDraft.from_pretrained``: see there."""
    plan = check(directory, target, cls)
    ckpt, cfg = plan.ckpt, plan.cfg
    device = torch.device(device if device is not None else "cpu")
    raw = _read_weights(weight_files(ckpt.directory))
    state = {plan.names[_strip_prefix(k)]: v for k, v in raw.items() if _strip_prefix(k) not in _IGNORED}
    layer = cfg.shapes
    for name, heads in (("attention.wq.weight", layer.n_heads), ("attention.wk.weight", layer.n_kv_heads)):
        state[name] = rotate_half_to_interleaved(state[name], heads)
    state = {k: (v.to(dtype) if v.is_floating_point() else v.long()) for k, v in state.items()}
    # Built on meta and then given the checkpoint's tensors: no random weights are made,
    # and a shared embedding or head is the target's own tensor, never a copy.
    draft = cls(cfg, dtype=dtype, device="meta", cache_device=device)
    shared = {"embed.weight": target.get_input_embeddings().weight, "head.weight": target.get_output_embeddings().weight}
    state.update({name: shared[name] for name in plan.shared})
    if "d2t" in dict(draft.named_buffers()) and "d2t" not in state:
        state["d2t"] = torch.zeros(cfg.draft_vocab_size or cfg.target.vocab_size, dtype=torch.long)
    draft.load_state_dict(state, strict=True, assign=True)
    draft._init_rope(*draft._rope_shape)  # the tables were made on meta
    return draft.to(device=device)
