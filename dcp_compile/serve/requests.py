"""The OpenAI request bodies ``dcp-compile serve`` takes, checked and read into a
``Completion``: ``/v1/completions`` (``parse_completion``) and ``/v1/chat/completions``
(``parse_chat``).  A field of the wrong type, or one this server does not implement, is a
``BadRequest`` naming it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from dcp_compile.runtime.engine import SamplingParams
from dcp_compile.text import Codec, IncrementalDecoder

_COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "seed", "stop", "stream", "stream_options", "n",
                            "user"})
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens"}


class BadRequest(ValueError):
    """A request the server refuses with 400."""


@dataclass
class Completion:
    """One request (a completion or a chat completion) as the HTTP side sees it."""

    prompt: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    model: str
    decoder: IncrementalDecoder
    chat: bool = False
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk carries the usage."""
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    engine_id: int | None = None
    # engine-thread side
    text: str = ""
    sent: int = 0
    tokens: int = 0
    cached_tokens: int = 0
    """Leading prompt tokens a paged pool's prefix cache held."""
    done: bool = False

    def __post_init__(self):
        if not self.id:
            self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": self.tokens,
                "total_tokens": len(self.prompt) + self.tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def _type_error(name: str, expected: str, value) -> BadRequest:
    return BadRequest(f"'{name}' must be {expected}, got {type(value).__name__} {value!r:.60}")


def _check_fields(body, fields: frozenset[str]) -> None:
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(f"unsupported fields {unknown}: this server implements {sorted(fields)}")


def _options(body: dict, name: str, max_tokens) -> tuple[SamplingParams, list[str], bool, bool]:
    """The sampling params, stop strings, ``stream`` and ``include_usage`` of a request
    whose ``max_tokens`` (read from field ``name``) is given."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _type_error(name, "an integer", max_tokens)
    if max_tokens < 1:
        raise BadRequest(f"'{name}' must be >= 1, got {max_tokens}")
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise _type_error("temperature", "a number", temperature)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _type_error("seed", "an integer", seed)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise _type_error("stop", "a non-empty string or a list of up to 4 of them", stop)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _type_error("stream", "a boolean", stream)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true")
    options = options or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} \
            or not isinstance(options.get("include_usage", False), bool):
        raise _type_error("stream_options", 'an object {"include_usage": a boolean}', options)
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest(f"'n' must be 1 (one completion per request), got {n!r}")
    # No eos_id: the engine's stop_ids (the codec's EOS ids) end every request.
    params = SamplingParams(max_new_tokens=max_tokens, temperature=None if temperature is None else float(temperature),
                            seed=seed)
    return params, stop, stream, options.get("include_usage", False)


def parse_completion(body, model: str, codec: Codec) -> Completion:
    """A ``/v1/completions`` body as a ``Completion``, or ``BadRequest`` saying what is wrong."""
    _check_fields(body, _COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        tokens = codec.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        tokens = prompt  # ids: the engine checks them against the vocabulary
    else:
        raise _type_error("prompt", "a string or a list of token ids", prompt)
    max_tokens = body.get("max_tokens")
    params, stop, stream, include_usage = _options(body, "max_tokens", 16 if max_tokens is None else max_tokens)
    return Completion(tokens, params, stop, stream, str(body.get("model") or model), codec.decoder(tokens),
                      include_usage=include_usage)


def parse_chat(body, model: str, codec: Codec, *, context: int) -> Completion:
    """A ``/v1/chat/completions`` body as a ``Completion`` of the rendered conversation, or
    ``ValueError`` saying what is wrong (a model without a chat template included).
    ``context``: the positions a prompt and its completion may take together; without
    ``max_tokens`` the completion may use what the prompt leaves of it."""
    _check_fields(body, _CHAT_FIELDS)
    tokens = codec.chat_ids(body.get("messages"))
    given = {name: body[name] for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise BadRequest(f"'max_completion_tokens' and its deprecated alias 'max_tokens' disagree: {given}")
    name, max_tokens = next(iter(given.items()), ("max_tokens", max(1, context - len(tokens))))
    params, stop, stream, include_usage = _options(body, name, max_tokens)
    return Completion(tokens, params, stop, stream, str(body.get("model") or model), codec.decoder(tokens), chat=True,
                      include_usage=include_usage)
