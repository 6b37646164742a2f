"""Tiny Hugging Face tokenizer directories, trained offline with ``tokenizers``.

Two families, because incremental decoding fails differently on each:

- ``byte_level``: GPT-2 / Llama-3 style byte-level BPE; a character of several UTF-8
  bytes can be split over tokens;
- ``sentencepiece``: Llama-2 / Mistral style (a ``▁`` for a space, byte fallback tokens
  ``<0xNN>``, one leading space stripped from a text), so a token's text depends on
  whether it starts the text.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The café serves crème brûlée and naïve piñatas.",
    "日本語のテキストと中文文本。",
    "Emoji: 🙂 🚀 ✓ — and “quotes”, ‘single’ ones; ½ ≤ ∞.",
    "Hello world! Hello there, how are you today?",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9",
]

BOS, EOS, END_OF_TURN = "<s>", "</s>", "<|end|>"
SPECIAL = [BOS, EOS, "<|start|>", END_OF_TURN, "<unk>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def _byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def _sentencepiece():
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # A small alphabet: the rarer characters are spelled in byte fallback tokens.
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, limit_alphabet=48)
    tok.train_from_iterator(CORPUS * 4, trainer)
    # Byte fallback as Llama-2 has it: the 256 <0xNN> tokens are ordinary vocabulary
    # (not special, so skip_special_tokens keeps them), and the decoder turns them back
    # into bytes.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ]}
    # A completion prompt starts with BOS, as Llama-2's does.
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [SPECIAL.index(BOS)], "tokens": [BOS]}},
    }
    return Tokenizer.from_str(json.dumps(spec))


FAMILIES = {"byte_level": _byte_level, "sentencepiece": _sentencepiece}


def tokenizer_dir(directory: Path, family: str = "byte_level", *, chat_template: str | None = CHAT_TEMPLATE,
                  generation_eos=None, config_eos=None) -> Path:
    """A model directory holding only a tokenizer of ``family`` (and, when given, a
    ``generation_config.json`` / ``config.json`` with those ``eos_token_id``)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=FAMILIES[family](), bos_token=BOS, eos_token=EOS,
                                        unk_token="<unk>", additional_special_tokens=["<|start|>", END_OF_TURN],
                                        clean_up_tokenization_spaces=False)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    if config_eos is not None:
        (directory / "config.json").write_text(json.dumps({"eos_token_id": config_eos}))
    return directory
