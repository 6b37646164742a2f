"""What a request asks of ``engine.SpecEngine`` and what it gets back."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float | None = None
    """``None``: the decoder's temperature; 0 is greedy."""
    seed: int | None = None
    """A generator of the request's own, so that its samples do not depend on the other
    requests in the batch; ``None`` draws from the engine's shared generator."""
    eos_id: int | None = None
    """Ends this request, as the engine's ``stop_ids`` end every request."""


def kv_need(prompt_tokens: int, max_new_tokens: int, k: int) -> int:
    """KV positions a request may fill: its prompt, its new tokens and a verify window."""
    return prompt_tokens + max_new_tokens + k + 1


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against (``SpecEngine.check_request``): plain data, so a
    process without the engine checks requests exactly as the engine would."""

    vocab: int
    max_seq_len: int
    k: int
    """Draft tokens a step verifies: a row needs ``k + 1`` positions past its last token."""
    temperature: float
    """The decoder's, for a request that gives none."""
    pool_tokens: int = 0
    """A paged target's pool, in tokens over the group; 0: each row holds ``max_seq_len``."""

    def check(self, prompt: Sequence[int], params: SamplingParams) -> tuple[list[int], float]:
        """The prompt as a list and the request's temperature, or ``ValueError`` saying what
        is wrong with them."""
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise ValueError(f"a prompt is a sequence of token ids, got {type(prompt).__name__}")
        tokens = list(prompt)
        if not tokens:
            raise ValueError("empty prompt: a request needs at least one token")
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab}); got {bad[:5]!r}")
        n = params.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {n!r}")
        need = kv_need(len(tokens), n, self.k)
        if need > self.max_seq_len:
            raise ValueError(
                f"prompt of {len(tokens)} tokens + max_new_tokens {n} + verify window {self.k + 1} needs {need} cache "
                f"positions; the cache holds max_seq_len={self.max_seq_len}"
            )
        if self.pool_tokens and need > self.pool_tokens:
            raise ValueError(
                f"prompt of {len(tokens)} tokens + max_new_tokens {n} + verify window {self.k + 1} needs {need} tokens "
                f"of KV, more than the whole pool's {self.pool_tokens} (kv_tokens): ask for fewer tokens")
        temperature = self.temperature if params.temperature is None else params.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if params.seed is not None and (isinstance(params.seed, bool) or not isinstance(params.seed, int)
                                        or not 0 <= params.seed < 2**63):
            raise ValueError(f"seed must be an int in [0, 2**63), got {params.seed!r}")
        if params.eos_id is not None and (isinstance(params.eos_id, bool) or not isinstance(params.eos_id, int)
                                          or not 0 <= params.eos_id < self.vocab):
            raise ValueError(f"eos_id must be a token id in [0, {self.vocab}), got {params.eos_id!r}")
        return tokens, float(temperature)


@dataclass
class StepEvent:
    """What one request did in one ``step``."""

    tokens: list[int] = field(default_factory=list)
    """New tokens (EOS included when it ended the request)."""
    accepted: list[int] = field(default_factory=list)
    """Draft tokens the target accepted in this step's verify (empty on admission)."""
    finished_by: str | None = None
    """``"eos"``, ``"length"`` or ``"aborted"`` when the request ended in this step."""
    cached_tokens: int | None = None
    """In the step whose prefill ended the prompt: its leading tokens that cached pages held."""


@dataclass
class RequestOutput:
    tokens: list[int] = field(default_factory=list)
    """Generated tokens (target vocabulary), EOS included when it ended the request."""
    accepted: list[int] = field(default_factory=list)
    """Per verify step: how many draft tokens the target accepted (0..k)."""
    finished_by: str = ""
    """``"eos"``, ``"length"`` or ``"refused"``."""
    error: str | None = None
    """Why the request was refused at admission."""
    cached_tokens: int = 0
    """Leading prompt tokens whose keys and values a paged pool's prefix cache held, so the
    prefill skipped them."""

    @property
    def mean_accept_length(self) -> float:
        """Tokens per verify step: accepted drafts plus the target's own token."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 0.0


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    temperature: float
    tokens: list[int] = field(default_factory=list)
    row: int | None = None
    fed: int = 0
    """Prompt tokens already prefilled; the request decodes once all are."""
    cached_tokens: int = 0
    """Of them, those a paged pool's prefix cache held at admission."""
    resumed: bool = False
    """Preempted once: ``prompt`` holds the tokens it had emitted, ``params`` the rest of its budget."""

    @property
    def decoding(self) -> bool:
        return self.fed == len(self.prompt)


def cut_at_stop(tokens: list[int], stops: frozenset[int]) -> tuple[list[int], bool]:
    """``tokens`` up to and including the first one in ``stops``, and whether there was one."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1], True
    return tokens, False
