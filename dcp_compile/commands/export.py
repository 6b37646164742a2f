"""Write a pair of this package (target + EAGLE3 draft) in the formats other engines read.

``export_pair("tiny-code", out)`` writes two directories:

- ``out/target/``: a ``transformers`` ``LlamaForCausalLM`` (``config.json``,
  ``generation_config.json``, ``model.safetensors``) and its byte-level tokenizer
  (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``);
- ``out/draft/``: the EAGLE3 draft in the published layout (``EAGLE_FORMATS.md`` section 1:
  ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; ``config.json`` with
  ``architectures ["LlamaForCausalLMEagle3"]``), without ``embed_tokens``: published drafts
  leave out the frozen embedding and loaders take the target's, which is checked equal first.

The weights are written as stored (bf16), renamed, with one change: this package rotates
interleaved RoPE pairs and ``transformers`` rotates halves, so the ``q_proj``/``k_proj``
rows are permuted per head (``models/rope_layout.py``); the outputs are unchanged.

**Tokenizer.**  Token id = byte value, as the model was trained: a BPE with no merges over
GPT-2's byte-to-character alphabet (``ByteLevel`` pre-tokenizer and decoder), so any text
encodes to its UTF-8 bytes, with no BOS added.  Byte 0, the document separator the model
ends a file with, is the EOS and pad token.  It is a special token under the name ``"\\x00"``
rather than its GPT-2 character ``"Ā"``: special tokens are matched in the raw text, and
``"Ā"`` would turn the character U+0100 into id 0 instead of its bytes ``c4 80``.

**Chat template.**  The model completes Python source, so the template turns a
conversation into the code prompt: each system message becomes a ``# `` comment block
(one ``# `` line per line), and user and assistant contents follow verbatim, in order;
``add_generation_prompt`` appends nothing.  For example ``[system "Sort a list.\\nStable.",
user "def sort(xs):\\n"]`` renders as ``"# Sort a list.\\n# Stable.\\ndef sort(xs):\\n"``.

``export_gguf(file, out)`` writes a GGUF model (``gguf_model``) as one plain Hugging Face
directory: ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, the
dequantized weights), ``tokenizer.json``, ``tokenizer_config.json`` and
``chat_template.jinja``, copied from the cache entry every command reads.

Needs the ``hf`` extra (``transformers``, ``tokenizers``; ``gguf`` for a GGUF model).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

try:
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "dcp_compile.commands.export needs Hugging Face transformers 5.x: pip install 'dcp-compile[hf]'"
    ) from error

from dcp_compile.commands import gguf_model
from dcp_compile.files import write_whole
from dcp_compile.models.eagle import EagleDraft
from dcp_compile.models.eagle_checkpoint import EAGLE3_NAMES, LAYER_NAMES
from dcp_compile.models.llama import Llama, LlamaConfig
from dcp_compile.models.pretrained import SHIPPED, load_pair, pair_configs
from dcp_compile.models.rope_layout import interleaved_to_rotate_half

EOS_ID = 0
"""Byte 0: the document separator the shipped models were trained with."""
MAX_POSITION_EMBEDDINGS = 4096
"""Written to both configs.  The native model has no position limit of its own (RoPE,
no learned positions); the shipped pair was trained on 512-byte windows."""
PAIR_FILES = ("config.json", "target.safetensors", "draft.safetensors")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% for line in message['content'].rstrip('\\n').split('\\n') %}{{ '# ' + line + '\\n' }}{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
)
"""See the module docstring: system messages as ``# `` comments, the rest verbatim."""


def _published(names) -> dict[str, str]:
    """This package's weight names -> the published ones: ``eagle_checkpoint``'s tables, read
    the other way, so that export and ``from_pretrained`` cannot disagree."""
    return {native: published for published, native in names.items()}


def gpt2_byte_chars() -> tuple[str, ...]:
    """GPT-2's ``bytes_to_unicode``: the printable character standing for each byte
    (index = byte), as ``tokenizers``' ``ByteLevel`` maps them.  Bytes that are printable
    Latin-1 (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for themselves; the other 68
    take ``chr(256), chr(257), ...`` in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return tuple(chars)


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The byte-level tokenizer of the module docstring: id = byte, EOS = pad = byte 0."""
    chars = gpt2_byte_chars()
    vocab = {chars[b]: b for b in range(1, 256)}
    vocab["\x00"] = EOS_ID  # matched as the special token before the ByteLevel mapping sees it
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no GPT-2 word splitting, which only matters for merges (there are none).
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("\x00", special=True, normalized=False)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="\x00",
        pad_token="\x00",
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        # Spaces are bytes like any other: " ." must decode as " .".
        clean_up_tokenization_spaces=False,
    )


def _pair_directory(name_or_path: str | Path) -> Path:
    if str(name_or_path) in SHIPPED:
        return SHIPPED[str(name_or_path)]
    path = Path(name_or_path)
    missing = [name for name in PAIR_FILES if not (path / name).is_file()]
    if missing:
        raise ValueError(
            f"{str(path)!r} is not a pair of this package (missing {', '.join(missing)}): export reads a shipped name "
            f"({', '.join(SHIPPED)}) or a directory written by `dcp-compile train --out DIR`, which holds "
            f"{', '.join(PAIR_FILES)}"
        )
    return path


def _feature_layer_keys(aux_layers: tuple[int, ...], n_layers: int) -> dict:
    """The draft config's record of which target layers it reads.

    The published default (inputs of ``2, L//2, L-3``) is what every engine assumes when
    the config names none, so nothing is written for it.  Otherwise both conventions are
    written, as each engine reads its own key: vLLM's top-level ids are layer inputs (as
    ``aux_layers`` here), SGLang's ``eagle_config`` ids are layer outputs (one less)."""
    if aux_layers == (2, n_layers // 2, n_layers - 3):
        return {}
    if len(aux_layers) != 3 or aux_layers[0] < 1 or aux_layers[-1] >= n_layers:
        raise ValueError(
            f"the draft reads the target's aux_layers {aux_layers} (layer inputs, {n_layers} layers); the published "
            f"EAGLE3 format reads the inputs of three layers in [1, {n_layers}) (SGLang names each as the output of "
            f"the layer before, so the embedding, input 0, cannot be named); retrain with aux_layers=(2, L//2, L-3)"
        )
    return {
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_layers]},
    }


def _renamed(state: dict[str, torch.Tensor], names: dict[str, str], heads: dict[str, int]) -> dict[str, torch.Tensor]:
    """``state`` under Hugging Face ``names``, q/k rows to rotate-half (``heads``: heads
    per permuted name).  Every native tensor must have a name: export drops nothing."""
    assert set(state) == set(names), f"tensors without a published name: {sorted(set(state) ^ set(names))}"
    tensors = {}
    for native, published in names.items():
        tensor = state[native]
        if published in heads:
            tensor = interleaved_to_rotate_half(tensor, heads[published])
        tensors[published] = tensor.detach().cpu().contiguous()
    return tensors


def _target_tensors(target: Llama) -> dict[str, torch.Tensor]:
    cfg = target.cfg
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    heads = {}
    for i in range(cfg.n_layers):
        prefix = f"model.layers.{i}."
        names |= {f"layers.{i}.{k}": prefix + v for k, v in _published(LAYER_NAMES).items()}
        names[f"layers.{i}.attention_norm.weight"] = prefix + "input_layernorm.weight"
        heads |= {prefix + "self_attn.q_proj.weight": cfg.n_heads, prefix + "self_attn.k_proj.weight": cfg.n_kv_heads}
    return _renamed(target.state_dict(), names, heads)


def _draft_tensors(draft: EagleDraft, target_embedding: torch.Tensor) -> dict[str, torch.Tensor]:
    layer = draft.cfg.shapes  # the draft layer's own heads (a pair of this package: the target's)
    state = draft.state_dict()
    embed = state.pop("embed.weight")
    names = {k: v for k, v in _published(EAGLE3_NAMES).items() if k in state}
    tensors = _renamed(state, names, {"midlayer.self_attn.q_proj.weight": layer.n_heads,
                                      "midlayer.self_attn.k_proj.weight": layer.n_kv_heads})
    if not torch.equal(embed, target_embedding.to(embed.device, embed.dtype)):
        # Loaders use the target's embedding unless the draft brings its own.
        tensors["embed_tokens.weight"] = embed.detach().cpu().contiguous()
    d2t = tensors["d2t"]
    t2d = torch.zeros(draft.cfg.target.vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t] = True
    tensors["t2d"] = t2d
    return tensors


def _target_config(cfg: LlamaConfig) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=False,
        # No BOS: the model was trained on windows cut anywhere in the byte stream.
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        dtype="bfloat16",
    )


def _draft_config(draft: EagleDraft, *, eos_token_id=EOS_ID, max_position_embeddings: int = MAX_POSITION_EMBEDDINGS,
                  dtype: str = "bfloat16") -> dict:
    target, layer = draft.cfg.target, draft.cfg.shapes
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": layer.dim,
        "intermediate_size": layer.intermediate_size,
        "num_attention_heads": layer.n_heads,
        "num_key_value_heads": layer.n_kv_heads,
        "head_dim": layer.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": layer.norm_eps,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft.head.weight.shape[0],
        # Written in both forms, since readers differ (legacy rope_theta; transformers 5
        # rope_parameters), and a draft config without it means 10000 to every engine
        # whatever the target uses.
        "rope_theta": layer.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": layer.rope_theta},
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False,
        "bias": draft.cfg.fc_bias,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id if isinstance(eos_token_id, int) else eos_token_id[0],
        "torch_dtype": dtype,
        **({"target_hidden_size": target.dim} if layer.dim != target.dim else {}),
        **_feature_layer_keys(target.aux_layers, target.n_layers),
    }


def _refuse_existing(out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"{out} already exists and is not an empty directory; export overwrites nothing: pass a new or empty "
            f"directory"
        )
    return out


def export_gguf(file: Path, out: str | Path, *, progress: bool = False) -> dict:
    """Write the GGUF model ``file`` to ``out`` as a plain Hugging Face directory (see the
    module docstring), whole or not at all.  Returns ``target`` (the directory), ``files``,
    ``target_parameters`` and ``source`` (the GGUF file)."""
    from safetensors import safe_open

    out = _refuse_existing(out)
    converted = gguf_model.converted(file)
    files = sorted(p for p in converted.iterdir() if p.is_file())

    def copy_into(temp: Path) -> None:
        for path in files:
            shutil.copy2(path, temp / path.name)

    gguf_model.publish(out, copy_into)
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        parameters = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    report = dict(target=str(out), files=[str(out / p.name) for p in files], target_parameters=parameters,
                  source=str(file))
    if progress:
        print(f"target: {out} (a Hugging Face directory from {file.name}, {parameters / 1e6:.2f} M parameters, "
              f"float32, tokenizer and chat template)")
    return report


def export_pair(name_or_path: str | Path, out: str | Path, *, progress: bool = False) -> dict:
    """Write the pair ``name_or_path`` (a shipped name or a ``dcp-compile train``
    directory) to ``out/target`` and ``out/draft``; see the module docstring.

    Returns what was written: ``target``, ``draft`` (the directories), ``files``, and
    ``target_parameters``, ``draft_parameters`` (the floating-point values in each
    ``model.safetensors``), ``draft_embed_tokens`` (whether the draft has its own embedding).
    Everything is checked before the first file is written."""
    from safetensors.torch import save_file

    out = _refuse_existing(out)
    directory = _pair_directory(name_or_path)
    cfg, draft_cfg = pair_configs(directory)
    if draft_cfg.kind != "eagle3":
        raise ValueError(
            f"{directory} holds an {draft_cfg.kind!r} draft; export writes the published EAGLE3 layout only "
            f"(EAGLE-1's layers.0.* layout is not written): train an EAGLE3 draft"
        )
    for what, scaling in (("target", cfg.rope_scaling), ("draft", draft_cfg.shapes.rope_scaling)):
        if scaling is not None:
            raise ValueError(f"{directory}'s {what} scales its RoPE ({scaling}); export writes plain RoPE only")
    target, draft = load_pair(directory, max_batch=1, max_seq_len=1, dtype=torch.bfloat16)
    target_tensors = _target_tensors(target)
    draft_tensors = _draft_tensors(draft, target.tok_embeddings.weight)
    draft_config = _draft_config(draft)

    target_dir, draft_dir = out / "target", out / "draft"
    target_dir.mkdir(parents=True)
    draft_dir.mkdir()
    metadata = {"format": "pt"}  # what transformers' loader checks for
    save_file(target_tensors, str(target_dir / "model.safetensors"), metadata=metadata)
    _target_config(cfg).save_pretrained(target_dir)
    transformers.GenerationConfig(eos_token_id=EOS_ID, pad_token_id=EOS_ID).save_pretrained(target_dir)
    byte_tokenizer().save_pretrained(target_dir)
    save_file(draft_tensors, str(draft_dir / "model.safetensors"), metadata=metadata)
    (draft_dir / "config.json").write_text(json.dumps(draft_config, indent=2) + "\n")

    def parameters(tensors: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() for t in tensors.values() if t.is_floating_point())

    report = dict(
        target=str(target_dir),
        draft=str(draft_dir),
        files=sorted(str(p) for p in out.rglob("*") if p.is_file()),
        target_parameters=parameters(target_tensors),
        draft_parameters=parameters(draft_tensors),
        draft_embed_tokens="embed_tokens.weight" in draft_tensors,
    )
    if progress:
        embedding = "its own embed_tokens" if report["draft_embed_tokens"] else "the target's embedding"
        print(f"target: {target_dir} (LlamaForCausalLM, {report['target_parameters'] / 1e6:.2f} M parameters, "
              f"tokenizer)")
        print(f"draft:  {draft_dir} (EAGLE3, {report['draft_parameters'] / 1e6:.2f} M parameters, {embedding})")
    return report


def write_eagle3_draft(draft: EagleDraft, target, out: str | Path, *, record: dict, history: dict) -> dict:
    """Write an EAGLE3 draft trained for the Hugging Face model ``target`` into ``out`` in
    the published layout (bf16 ``model.safetensors``, ``config.json``), with its training
    record (``training.json``) and a model card (``README.md``).  Each file is written
    under a temporary name and renamed, ``config.json`` last, so a reader never finds a
    config over missing or partial weights."""
    from safetensors.torch import save_file

    out = Path(out)
    text = target.config.get_text_config(decoder=True)
    eos = target.generation_config.eos_token_id if getattr(target, "generation_config", None) else None
    eos = eos if eos is not None else text.eos_token_id
    tensors = {name: t.to(torch.bfloat16) if t.is_floating_point() else t
               for name, t in _draft_tensors(draft, target.get_input_embeddings().weight).items()}
    config = _draft_config(draft, eos_token_id=eos,
                           max_position_embeddings=getattr(text, "max_position_embeddings", MAX_POSITION_EMBEDDINGS))
    files = {
        "model.safetensors": lambda path: save_file(tensors, str(path), metadata={"format": "pt"}),
        "training.json": lambda path: path.write_text(json.dumps(dict(record, history=history)) + "\n"),
        "README.md": lambda path: path.write_text(draft_card(record)),
        "config.json": lambda path: path.write_text(json.dumps(config, indent=2) + "\n"),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, write in files.items():
        write_whole(out / name, write)
    return dict(draft=str(out), parameters=sum(t.numel() for t in tensors.values() if t.is_floating_point()))


def draft_card(record: dict) -> str:
    """The model card of a draft ``dcp-compile train-draft`` wrote, from its record."""
    s = record["settings"]
    lines = [
        f"# EAGLE3 draft for {Path(record['model']).name}",
        "",
        "Trained by `dcp-compile train-draft`, in the published EAGLE3 layout (as SpecForge writes it and",
        "vLLM and SGLang read it), read by `EagleDraft.from_pretrained` and `dcp-compile demo/serve/eval --draft`.",
        "",
        f"- **Target:** `{record['model']}`; features: the hidden states entering layers {record['feature_layers']}.",
        f"- **Data:** {record['conversations']} chat prompts built from the Python standard library's documented "
        f"functions (train split), answered greedily by the target ({record['answer_tokens']} answer tokens, "
        f"{record['tokens']} tokens in all).",
        f"- **Draft vocabulary:** the {record['draft_vocab']} ids the conversations use most.",
        f"- **Training:** {s['steps']} steps of {s['batch']} conversations (up to {s['max_len']} tokens), "
        f"{s['ttt_steps']} unrolled steps, AdamW at {s['lr']}, started from the target's layer "
        f"{record['feature_layers'][-1]} and LM head.",
        f"- **Time:** {record['seconds'] / 60:.1f} min on {record['device']} ({record['generate_seconds'] / 60:.1f} min "
        f"generating the answers).",
        f"- **Top-1 agreement with the target** over the last 20 steps, by unrolled step: {record['final_agreement']}.",
    ]
    if "acceptance" in record:
        a = record["acceptance"]
        lines.append(f"- **Mean accept length:** {a['mean_accept_length']:.2f} at k={a['k']} (greedy, "
                     f"{'chain' if a['topk'] == 1 else 'tree'}) on {a['prompts']} held-out chat prompts.")
    return "\n".join(lines) + "\n"
