"""What an EAGLE or EAGLE3 draft is built from: its config (``DraftConfig``), the shape of
a target that is not a ``LlamaConfig`` (``TargetShape``), what a checkpoint's draft reads
of its target (``DraftHost``), and EAGLE3's default feature layers.

Apart from the model (``eagle.EagleDraft``) so that the checkpoint reader
(``eagle_checkpoint``), which ``EagleDraft.from_pretrained`` calls, needs only these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from torch import nn

from dcp_compile.models.llama import LlamaConfig


def eagle3_aux_layers(n_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states EAGLE3 reads: ``2, L//2, L-3``.

    Shallow targets make those collide; the set is then filled with the lowest unused
    layers, so a target of ``L >= 3`` layers always gives three features (and ``L < 3``
    gives ``L``)."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    chosen = {min(2, n_layers - 1), n_layers // 2, max(n_layers - 3, 0)}
    spare = (i for i in range(n_layers) if i not in chosen)
    while len(chosen) < min(3, n_layers):
        chosen.add(next(spare))
    return tuple(sorted(chosen))


@dataclass(frozen=True)
class TargetShape:
    """What a draft needs of its target when the target is not a ``LlamaConfig`` (a Hugging
    Face model, an MLA target): its width, vocabulary, depth, features and cache size."""

    vocab_size: int
    dim: int
    n_layers: int
    aux_layers: tuple[int, ...]
    """The target layers whose hidden states it returns as features (``LlamaConfig.aux_layers``)."""
    max_batch: int
    max_seq_len: int


@dataclass(frozen=True)
class DraftConfig:
    target: LlamaConfig | TargetShape
    """The target the draft proposes tokens for (width, vocabulary, features, cache size;
    and, when ``layer`` is ``None``, the draft layer's shapes)."""
    kind: str = "eagle3"
    """``"eagle3"`` or ``"eagle"`` (EAGLE-1, whose weights EAGLE-2 shares)."""
    n_features: int | None = None
    """EAGLE3: target hidden states concatenated into ``fc``.  ``None``: as many as the
    target returns (``len(target.aux_layers)``, or 3 for a target built without them)."""
    draft_vocab_size: int | None = None
    """EAGLE3: size of the draft's own LM head; None means the target vocabulary."""
    layer: LlamaConfig | None = None
    """The draft's own decoder layer: width, heads, head width, MLP width, norm eps and
    RoPE, as a published checkpoint's config.json gives them.  ``None``: the target's.
    Its cache rows and positions are always the target's."""
    fc_bias: bool | None = None
    """Whether ``fc`` has a bias; ``None``: the published default of the kind (EAGLE-1
    has one unless its config says ``"bias": false``, EAGLE3 has none)."""

    def __post_init__(self) -> None:
        if self.kind not in ("eagle", "eagle3"):
            raise ValueError(f"kind must be 'eagle' or 'eagle3', got {self.kind!r}")
        if self.draft_vocab_size is not None and self.kind == "eagle":
            raise ValueError("a reduced draft vocabulary is an EAGLE3 feature; EAGLE uses the target's LM head")
        if self.layer is None and isinstance(self.target, TargetShape):
            raise ValueError("a draft for a TargetShape needs its own layer shapes: pass layer=LlamaConfig(...)")
        if self.fc_bias is None:
            object.__setattr__(self, "fc_bias", self.kind == "eagle")
        returned = len(self.target.aux_layers)
        if self.n_features is None:
            object.__setattr__(self, "n_features", returned or 3)
        width = self.shapes.dim
        if self.kind == "eagle":
            if width != self.target.dim:
                raise ValueError(
                    f"an EAGLE-1 draft computes its logits with the target's LM head, so its width must be the "
                    f"target's: got a draft {width} wide for a target {self.target.dim} wide"
                )
            return
        if returned and self.n_features != returned:
            raise ValueError(
                f"the EAGLE3 draft reads n_features={self.n_features} target hidden states but the target returns "
                f"{returned} (aux_layers={self.target.aux_layers}); leave n_features unset to follow the target"
            )
        if self.n_features < 2:
            raise ValueError(
                f"an EAGLE3 draft needs at least 2 target features, got {self.n_features}: with one, fc's input is "
                f"as wide as the draft's own hidden state, which later draft steps feed back in its place. Build "
                f"the target with aux_layers=eagle3_aux_layers(n_layers) (3 layers for n_layers >= 3)"
            )
        if self.n_features * self.target.dim == width:
            raise ValueError(
                f"the target's {self.n_features} features ({self.n_features} x {self.target.dim}) are as wide as the "
                f"draft's own hidden state ({width}): later draft steps, which feed that state back, could not be told "
                f"apart from the first"
            )

    @property
    def shapes(self) -> LlamaConfig:
        """The draft layer's shapes, with the target's cache rows and positions."""
        base = self.layer if self.layer is not None else self.target
        return replace(base, n_layers=1, aux_layers=(), max_batch=self.target.max_batch,
                       max_seq_len=self.target.max_seq_len)

    @property
    def feature_width(self) -> int:
        """Width of the target features the draft reads."""
        return self.target.dim * (self.n_features if self.kind == "eagle3" else 1)


class DraftHost(Protocol):
    """What a draft loaded from a checkpoint reads of its target (``Llama``, the MLA target
    and ``hf.DCPCausalLM`` all have it): shapes, features, cache size, and the token
    embedding and LM head a checkpoint may leave out."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    aux_layers: tuple[int, ...]
    cache_shape: tuple[int, int]

    def get_input_embeddings(self) -> nn.Embedding: ...

    def get_output_embeddings(self) -> nn.Linear: ...
