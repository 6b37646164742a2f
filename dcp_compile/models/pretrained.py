"""Saving and loading a target + EAGLE draft pair as safetensors with one config file.

A checkpoint directory holds ``target.safetensors``, ``draft.safetensors`` and
``config.json`` (model shapes plus what training recorded).  The cache shape
(``max_batch``, ``max_seq_len``) is not part of a checkpoint: it is the server's
choice, given when loading.

The package ships one pair, ``tiny-code`` (``dcp_compile/assets/tiny-code``): a
byte-level Llama trained on the Python standard library and its EAGLE3 draft; its
model card is ``MODEL_CARD.md`` beside the weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import MappingProxyType

import torch

from dcp_compile.models.eagle import DraftConfig, EagleDraft
from dcp_compile.models.llama import Llama, LlamaConfig

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED = MappingProxyType({"tiny-code": ASSETS / "tiny-code"})
_SERVER_FIELDS = ("max_batch", "max_seq_len")


def save_pair(directory: str | Path, target: Llama, draft: EagleDraft, extra: dict | None = None) -> Path:
    """Write the pair in bf16 (the shipped size) with its config; returns the directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        state = model.state_dict()
        return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in state.items()}

    save_file(tensors(target), str(directory / "target.safetensors"))
    save_file(tensors(draft), str(directory / "draft.safetensors"))
    target_fields = {k: v for k, v in dataclasses.asdict(target.cfg).items() if k not in _SERVER_FIELDS}
    config = dict(
        target=target_fields,
        draft=dict(kind=draft.cfg.kind, n_features=draft.cfg.n_features, draft_vocab_size=draft.cfg.draft_vocab_size),
        **(extra or {}),
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def _resolve(name_or_path: str | Path) -> Path:
    if str(name_or_path) in SHIPPED:
        return SHIPPED[str(name_or_path)]
    path = Path(name_or_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"no checkpoint directory at {str(path)!r}; expected a shipped name ({', '.join(SHIPPED)}) or a directory "
            f"written by `dcp-compile train --out DIR`"
        )
    return path


def load_config(name_or_path: str | Path = "tiny-code") -> dict:
    path = _resolve(name_or_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a checkpoint directory needs config.json beside the weights")
    return json.loads(path.read_text())


def pair_configs(name_or_path: str | Path = "tiny-code", **cache) -> tuple[LlamaConfig, DraftConfig]:
    """The target and draft configs of a checkpoint; ``cache`` sets ``max_batch`` and
    ``max_seq_len`` (the config's defaults when omitted)."""
    directory = _resolve(name_or_path)
    config = load_config(directory)
    try:
        fields = dict(config["target"], aux_layers=tuple(config["target"]["aux_layers"]))
        cfg = LlamaConfig(**fields, **cache)
        return cfg, DraftConfig(cfg, **config["draft"])
    except (KeyError, TypeError) as err:
        raise ValueError(
            f"{directory / 'config.json'} does not describe a target and draft ({type(err).__name__}: {err}); "
            f"expected the 'target' and 'draft' sections `dcp-compile train` writes"
        ) from err


def load_pair(
    name_or_path: str | Path = "tiny-code",
    *,
    max_batch: int,
    max_seq_len: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_device: str | torch.device | None = None,
) -> tuple[Llama, EagleDraft]:
    """The target and draft of a checkpoint, in eval mode, with caches for
    ``max_batch`` sequences of ``max_seq_len`` tokens.  ``cache_device="meta"`` leaves the
    target's caches for ``dcp.prepare`` to allocate (a paged target's never exist whole)."""
    from safetensors.torch import load_file

    directory = _resolve(name_or_path)
    files = [directory / "target.safetensors", directory / "draft.safetensors"]
    for weights in files:
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} is missing from the checkpoint directory")
    cfg, draft_cfg = pair_configs(directory, max_batch=max_batch, max_seq_len=max_seq_len)
    target, draft = Llama(cfg, dtype=dtype, device=device, cache_device=cache_device), EagleDraft(draft_cfg)
    for model, weights in zip((target, draft), files):
        state = load_file(str(weights))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{weights} does not match its config.json: missing {sorted(missing)}, unexpected {sorted(unexpected)}; "
                f"the weights and the config must come from the same training run"
            )
    return target.eval(), draft.to(device=device, dtype=dtype).eval()
