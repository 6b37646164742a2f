"""What ``--model`` and ``--draft`` name, and how each is loaded.

``--model`` is one of

- a shipped name (``tiny-code``) or a directory ``dcp-compile train`` wrote: a target and
  its EAGLE3 draft in this package's own format (``config.json`` with ``target`` and
  ``draft`` sections), read by ``models.pretrained``;
- a Hugging Face causal-LM directory (``config.json`` with ``model_type``), loaded by
  transformers from disk (never the hub) in the serving dtype straight onto the device,
  and wrapped in ``hf.DCPCausalLM``;
- a GGUF file (a short name such as ``smollm2``, a ``.gguf`` path, or a directory holding
  one ``.gguf``), read through transformers once into a Hugging Face directory in the
  cache (``gguf_model``), which is then loaded as above.

``--draft`` names an EAGLE3 or EAGLE-1 checkpoint directory in the published layouts
(``EagleDraft.from_pretrained``); only an HF or GGUF model takes one, since a pair brings
its own.  An HF or GGUF model without a draft is decoded by DCP without speculation.

``resolve`` reads configs and weight shapes only, and refuses a bad combination (a draft
for another model too) with what it found and the fix, so a command can refuse before any
rank starts (the one exception: a GGUF file not yet in the cache is converted here, once);
``load`` builds the models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dcp_compile.files import read_json_object as _read_json

PAIR, HF, GGUF = "pair", "hf", "gguf"


@dataclass(frozen=True)
class ModelSpec:
    """A checked ``--model`` (and ``--draft``): what to load, nothing loaded yet."""

    name: str
    """As the user gave it (a shipped name or a path)."""
    kind: str
    """``"pair"`` (this package's target + draft format), ``"hf"``, or ``"gguf"`` (a GGUF
    file, loaded as the Hugging Face directory converted from it)."""
    path: Path
    """The model directory (for ``"gguf"``: the converted directory in the cache)."""
    draft: Path | None = None
    """An HF or GGUF model's draft checkpoint directory; ``None``: no speculation (a pair
    always brings its own draft)."""
    source: Path | None = None
    """The GGUF file of a ``"gguf"`` model; ``None`` for the other kinds."""

    @property
    def speculative(self) -> bool:
        return self.kind == PAIR or self.draft is not None


def resolve(model: str, draft: str | None = None) -> ModelSpec:
    """The checked ``ModelSpec`` of ``--model`` and ``--draft``; raises ``FileNotFoundError``
    or ``ValueError`` naming what was expected, what was found and the fix."""
    from dcp_compile.models.pretrained import SHIPPED, pair_configs

    if model in SHIPPED or (Path(model) / "config.json").is_file() and "target" in _read_json(
            Path(model) / "config.json", "a model directory holds a config.json object"):
        if draft is not None:
            raise ValueError(
                f"--draft {draft!r} was given with --model {model!r}, a target and draft pair in this package's format "
                f"that brings its own draft; --draft goes with a Hugging Face model directory"
            )
        pair_configs(model)
        return ModelSpec(model, PAIR, SHIPPED.get(model, Path(model)))
    from dcp_compile.commands import gguf_model

    source = gguf_model.find(model)
    path = _hf_directory(model) if source is None else gguf_model.converted(source)
    kind = HF if source is None else GGUF
    config = check_hf_config(path)
    if draft is None:
        return ModelSpec(model, kind, path, source=source)
    _check_draft(Path(draft), config.get_text_config(decoder=True))
    return ModelSpec(model, kind, path, Path(draft), source)


def _hf_directory(model: str) -> Path:
    """``model`` checked to be a Hugging Face checkpoint directory with its weights."""
    from dcp_compile.commands.gguf_model import SHORT_NAMES
    from dcp_compile.models.eagle_checkpoint import weight_files
    from dcp_compile.models.pretrained import SHIPPED

    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(
            f"no checkpoint directory at {model!r}; expected a shipped name ({', '.join(SHIPPED)}), a directory "
            f"written by `dcp-compile train --out DIR`, a Hugging Face causal-LM directory (config.json and its "
            f"weights), or a GGUF file (a .gguf path, or a short name: {', '.join(SHORT_NAMES)})"
        )
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{config_path} is missing: a model directory is a Hugging Face checkpoint (config.json with model_type, "
            f"and its weights), one `dcp-compile train` wrote (config.json with target and draft), or one that holds "
            f"a single .gguf file"
        )
    config = _read_json(config_path, "a model directory holds a config.json object")
    if "model_type" not in config:
        raise ValueError(
            f"{config_path} is neither format: it has no 'model_type' (a Hugging Face checkpoint) and no 'target' and "
            f"'draft' sections (a `dcp-compile train` directory); found the keys {sorted(config)[:12]}"
        )
    weight_files(path, "model")
    return path


def check_hf_config(path: Path):
    """The HF config of ``path``, refused when DCP cannot shard the family (before any
    weight is read)."""
    from transformers import AutoConfig

    from dcp_compile import hf

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(f"transformers cannot read {path / 'config.json'}: {err}") from err
    hf.check_shardable(config)
    return config


@dataclass(frozen=True)
class _ConfiguredTarget:
    """An HF target's shapes from its config alone (an ``draft_config.DraftHost`` without weights)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    aux_layers: tuple[int, ...]
    cache_shape: tuple[int, int] = (1, 1)


def _check_draft(draft: Path, config) -> None:
    """Refuse a draft that cannot serve the model of ``config`` (another width, vocabulary or
    depth, an extension not computed here), from the configs and weight shapes alone."""
    from dcp_compile.models.eagle import EagleDraft
    from dcp_compile.models.eagle_checkpoint import check, feature_layers

    layers = config.num_hidden_layers
    check(draft, _ConfiguredTarget(config.vocab_size, config.hidden_size, layers, feature_layers(draft, layers)),
          EagleDraft)


def load(spec: ModelSpec, *, max_batch: int, max_seq_len: int, device: torch.device | str = "cpu",
         dtype: torch.dtype = torch.float32, native: bool = False, paged: bool = False):
    """``(target, draft or None)``, in eval mode, on ``device``, with caches for
    ``max_batch`` rows of ``max_seq_len`` positions.  ``native``: a Hugging Face or GGUF
    Llama as this package's own ``Llama`` (``hf.native``), which ``dcp.tensor_parallel``
    shards, rather than through transformers.  ``paged``: the target leaves its caches on
    meta for ``dcp.prepare`` to page (their rows never exist whole)."""
    if spec.kind == PAIR:
        from dcp_compile.models.pretrained import load_pair

        return load_pair(spec.path, max_batch=max_batch, max_seq_len=max_seq_len, device=device, dtype=dtype,
                         cache_device="meta" if paged else None)
    from transformers import AutoConfig

    from dcp_compile.hf import DCPCausalLM, load_causal_lm
    from dcp_compile.hf.native import load_llama
    from dcp_compile.models.eagle import EagleDraft
    from dcp_compile.models.eagle_checkpoint import feature_layers

    if native:
        config = AutoConfig.from_pretrained(str(spec.path), local_files_only=True)
        aux = () if spec.draft is None else feature_layers(spec.draft, config.get_text_config(decoder=True))
        target = load_llama(spec.path, max_batch=max_batch, max_seq_len=max_seq_len, aux_layers=aux, dtype=dtype,
                            device=device, cache_device="meta" if paged else None)
    else:
        model = load_causal_lm(spec.path, device=device, dtype=dtype)
        aux = () if spec.draft is None else feature_layers(spec.draft, model.config.get_text_config(decoder=True))
        target = DCPCausalLM(model, max_batch=max_batch, max_seq_len=max_seq_len, aux_layers=aux,
                             cache_device="meta" if paged else None).eval()
    if spec.draft is None:
        return target, None
    return target, EagleDraft.from_pretrained(spec.draft, target, dtype=dtype, device=device).eval()


def pool_options(page_size: int, kv_tokens: int | None, max_batch: int, max_seq_len: int) -> dict:
    """``SpecDecoder``'s ``page_size`` and ``kv_tokens`` for ``--page-size`` / ``--kv-tokens``
    (``kv_tokens`` by default: what the rows would hold), or none without a page size."""
    if not page_size:
        return {}
    kv_tokens = kv_tokens or max_batch * max_seq_len
    if kv_tokens < max_seq_len:
        from dcp_compile.runtime.launch import UsageError

        raise UsageError(f"--kv-tokens {kv_tokens} holds less than one request of these prompts, "
                         f"{max_seq_len} tokens (the longest prompt, --max-new-tokens and the verify window)")
    return dict(page_size=page_size, kv_tokens=kv_tokens)


def codec(spec: ModelSpec):
    """The text codec of the model: bytes for a pair, the directory's tokenizer (with its
    chat template) for HF and GGUF."""
    from dcp_compile import text

    if spec.kind == PAIR:
        return text.ByteCodec(eos_id=text.SHIPPED_EOS)
    return text.HFCodec(spec.path)
