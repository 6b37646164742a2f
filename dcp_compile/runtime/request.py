"""What a request asks of ``engine.SpecEngine`` and what it gets back."""

from __future__ import annotations

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


@dataclass
class StepEvent:
    """What one request did in one ``step``."""

    tokens: list[int] = field(default_factory=list)
    """New tokens (EOS included when it ended the request)."""
    accepted: list[int] = field(default_factory=list)
    """Draft tokens the target accepted in this step's verify (empty on admission)."""
    finished_by: str | None = None
    """``"eos"``, ``"length"`` or ``"aborted"`` when the request ended in this step."""


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

    @property
    def decoding(self) -> bool:
        return self.fed == len(self.prompt)


def cut_at_stop(tokens: list[int], stops: frozenset[int]) -> tuple[list[int], bool]:
    """``tokens`` up to and including the first one in ``stops``, and whether there was one."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1], True
    return tokens, False
