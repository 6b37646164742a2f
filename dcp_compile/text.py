"""The text side of a model: prompts to token ids, token ids back to text, and its ends.

Two codecs with one interface (``Codec``):

- ``ByteCodec``: the shipped byte-level models; a token is a byte of UTF-8, the document
  separator ends a completion, and there is no chat template (chat requests are refused);
- ``HFCodec``: a Hugging Face model directory's tokenizer (read from disk, never the
  hub), its EOS ids from ``generation_config.json`` / ``config.json``, and its chat
  template.

A completion streams through an ``IncrementalDecoder``: ``push`` the new token ids, get
the text that is now final.  Its text, once ``finish`` is called, equals the one-shot
decode of every pushed id (EOS ids and special tokens left out), however the ids were
split between pushes, and each push costs a decode of a short window, not of the whole
completion.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from dcp_compile.files import read_json_object

SHIPPED_EOS = 0
"""The document separator the shipped byte-level models were trained with."""

ROLES = ("system", "user", "assistant", "tool")
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_call_id"})

CONTEXT_TOKENS = 6
"""Prompt tokens a completion's decoder starts from, so that its first tokens decode as
they do after the prompt (a SentencePiece leading space is kept, not stripped as at the
start of a text)."""


class IncrementalDecoder(Protocol):
    def push(self, token_ids: Sequence[int]) -> str:
        """Take the next token ids; return the text that is now final."""

    def finish(self) -> str:
        """The rest of the text (an incomplete character becomes U+FFFD)."""


class Codec(Protocol):
    eos_ids: frozenset[int]
    """Token ids that end a completion; they are never part of its text."""
    has_chat_template: bool

    def encode(self, text: str) -> list[int]:
        """A completion prompt as token ids, with the tokenizer's usual special tokens."""

    def chat_ids(self, messages) -> list[int]:
        """Checked chat messages rendered by the chat template, up to the assistant's turn;
        ``ValueError`` for bad messages or a model without a chat template."""

    def decoder(self, prompt: Sequence[int] = ()) -> IncrementalDecoder:
        """A decoder for the completion of ``prompt``."""


def check_messages(messages) -> list[dict]:
    """``messages`` as a list of plain ``{"role", "content"}`` dicts, or ``ValueError``
    naming the first message that is wrong and what was found."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'messages' must be a non-empty list of messages, got {type(messages).__name__} "
                         f"{messages!r:.60}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got "
                             f"{type(message).__name__} {message!r:.60}")
        unknown = sorted(set(message) - _MESSAGE_KEYS)
        if unknown:
            raise ValueError(f"messages[{i}] has unsupported fields {unknown}; a message has {sorted(_MESSAGE_KEYS)}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {list(ROLES)}, got {role!r:.60}")
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(content).__name__} "
                             f"{content!r:.60}")
        for key in ("name", "tool_call_id"):
            if key in message and not isinstance(message[key], str):
                raise ValueError(f"messages[{i}][{key!r}] must be a string, got {type(message[key]).__name__}")
        checked.append(dict(message))
    return checked


class _ByteDecoder:
    def __init__(self, eos_ids: frozenset[int]):
        self._drop = eos_ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_ids: Sequence[int]) -> str:
        return self._utf8.decode(bytes(t for t in token_ids if t not in self._drop))

    def finish(self) -> str:
        return self._utf8.decode(b"", final=True)


class ByteCodec:
    """The shipped byte-level models: token ``i`` is the byte ``i``."""

    has_chat_template = False

    def __init__(self, eos_id: int = SHIPPED_EOS, *, name: str = "the shipped byte-level model"):
        if isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id < 256:
            raise ValueError(f"a byte-level model's eos_id is a byte value in [0, 256), got {eos_id!r}")
        self.eos_ids = frozenset({eos_id})
        self.name = name

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def chat_ids(self, messages) -> list[int]:
        raise ValueError(f"{self.name} has no chat template: it reads and writes raw UTF-8 bytes; send the text as "
                         f"'prompt' to /v1/completions")

    def decoder(self, prompt: Sequence[int] = ()) -> IncrementalDecoder:
        # Bytes need no context: a UTF-8 decoder keeps an incomplete character itself.
        return _ByteDecoder(self.eos_ids)


class _WindowDecoder:
    """Incremental detokenization for a tokenizer whose decode of a token depends on its
    neighbours.

    ``ids[prefix:read]`` is text already emitted, kept as left context; ``ids[read:]``
    is not emitted yet.  Each push decodes ``ids[prefix:]`` and emits what it adds to
    ``decode(ids[prefix:read])``, unless it ends in U+FFFD (a character whose bytes are
    not all in yet).  Both decodes start at the same token, so whatever the tokenizer
    does at the start of a text (strip a leading space) cancels out; the window then
    moves up to the end.
    """

    def __init__(self, decode, drop: frozenset[int], context: Sequence[int]):
        self._decode = decode
        self._drop = drop
        self._ids = [t for t in context if t not in drop]
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text: str | None = None

    def _step(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if not final and (len(text) <= len(self._prefix_text) or text.endswith("\ufffd")):
            return ""
        new = text[len(self._prefix_text):]
        del self._ids[:self._read]
        self._prefix, self._read, self._prefix_text = 0, len(self._ids), None
        return new

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids += [t for t in token_ids if t not in self._drop]
        return self._step(final=False)

    def finish(self) -> str:
        return self._step(final=True)


def _eos_field(value, where: Path) -> frozenset[int] | None:
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{where}: 'eos_token_id' must be a token id or a list of them, got {value!r:.80}")
    return frozenset(ids)


def _read_eos(path: Path) -> frozenset[int] | None:
    if not path.is_file():
        return None
    return _eos_field(read_json_object(path).get("eos_token_id"), path)


class HFCodec:
    """A Hugging Face model directory's tokenizer, EOS ids and chat template."""

    def __init__(self, directory: str | Path):
        from transformers import AutoTokenizer

        self.directory = Path(directory)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"transformers cannot load a tokenizer from {self.directory}: {err}") from err
        # What generation stops on, in the order transformers' generate() reads it.
        eos = _read_eos(self.directory / "generation_config.json")
        if eos is None:
            eos = _read_eos(self.directory / "config.json")
        if eos is None:
            eos = frozenset() if self.tokenizer.eos_token_id is None else frozenset({self.tokenizer.eos_token_id})
        self.eos_ids: frozenset[int] = eos

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def chat_ids(self, messages) -> list[int]:
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer in {self.directory} has no chat template (no 'chat_template' in its "
                             f"tokenizer_config.json or chat_template.jinja): send the text as 'prompt' to "
                             f"/v1/completions")
        messages = check_messages(messages)
        from jinja2 import TemplateError

        try:
            # return_dict: a BatchEncoding on every transformers 5.x, whatever its default.
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)
        except TemplateError as err:
            raise ValueError(f"the chat template of {self.directory} refused the messages: {err}") from err
        return [int(t) for t in rendered["input_ids"]]

    def decode(self, token_ids: Sequence[int]) -> str:
        """The one-shot decode the incremental decoder agrees with."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def decoder(self, prompt: Sequence[int] = ()) -> IncrementalDecoder:
        return _WindowDecoder(self.decode, self.eos_ids, list(prompt)[-CONTEXT_TOKENS:])
