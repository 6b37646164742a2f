"""EAGLE and EAGLE3 draft models: one decoder layer over the target's features.

Both keep their own KV cache, whole on every rank (``dcp.prepare(draft, group,
role="draft", ...)``), written and read the same way as the target's, so the same
``find`` pass sees them and ``check_draft`` proves they were left alone.

- **EAGLE** (EAGLE-1, as published): ``fc(cat(embed(token), feature))`` with a bias,
  where the feature is the target's final normed hidden state (``aux_layers=(n_layers,)``),
  then one decoder layer whose attention has no input norm, then the target's LM head
  on the un-normed output.
- **EAGLE3**: the hidden states entering three target layers (default ``2, L//2, L-3``)
  go through ``fc: 3H -> H``; the decoder layer attends over
  ``cat(norm(embed(token)), norm(hidden))`` (2H) with the residual on the hidden part;
  its own LM head covers a draft vocabulary, mapped to target ids by ``d2t``
  (target id = draft id + d2t[draft id]).  Later draft steps feed the draft's own
  output hidden state instead of the target's features.

``forward(tokens [B, T], positions [B, T], features) -> (logits [B, T, V_target], hidden
[B, T, H])``; ``features`` is the target's ``[B, T, k*H]`` auxiliary hidden states or
the draft's own previous ``[B, T, H]`` output.

A draft's layer may have shapes of its own (``DraftConfig.layer``: heads, head width,
MLP width, norm eps, RoPE theta and scaling), as published drafts do; the config lives in
``draft_config``.  ``EagleDraft.from_pretrained`` reads the EAGLE3 and EAGLE-1 checkpoint
layouts (``eagle_checkpoint``, which never imports this module).
"""

from __future__ import annotations

import torch
from torch import nn

from dcp_compile.models.draft_config import DraftConfig, DraftHost
from dcp_compile.models.llama import Attention, FeedForward, RMSNorm, RopeTables, take_rows


class EagleDraft(RopeTables):
    def __init__(self, cfg: DraftConfig, *, dtype: torch.dtype = torch.float32, device=None, cache_device=None):
        super().__init__()
        self.cfg = cfg
        t, layer = cfg.target, cfg.shapes
        width = layer.dim
        self.embed = nn.Embedding(t.vocab_size, width)
        if cfg.kind == "eagle":
            # EAGLE-1: fc over cat(embedding, feature), a decoder layer with no input norm,
            # and the target's LM head on the un-normed output.
            self.fc = nn.Linear(width + t.dim, width, bias=cfg.fc_bias)
            self.attention = Attention(layer, dtype)
            self.head = nn.Linear(width, t.vocab_size, bias=False)
        else:
            self.fc = nn.Linear(cfg.n_features * t.dim, width, bias=cfg.fc_bias)
            self.embed_norm = RMSNorm(width, layer.norm_eps)
            self.hidden_norm = RMSNorm(width, layer.norm_eps)
            self.attention = Attention(layer, dtype, in_features=2 * width)
            vocab = cfg.draft_vocab_size or t.vocab_size
            self.norm = RMSNorm(width, layer.norm_eps)
            self.head = nn.Linear(width, vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.long))
        self.ffn_norm = RMSNorm(width, layer.norm_eps)
        self.feed_forward = FeedForward(layer)
        self._init_rope(layer.head_dim, t.max_seq_len, layer.rope_theta, layer.rope_scaling)
        self.to(device=device, dtype=dtype)
        self.attention.allocate_cache(cache_device if cache_device is not None else self.fc.weight.device)

    @classmethod
    def from_pretrained(cls, directory, target: DraftHost, *, dtype: torch.dtype = torch.float32,
                        device=None) -> EagleDraft:
        """A published EAGLE3 or EAGLE-1 draft checkpoint, for ``target``.

        The layout is detected from the weight names (``midlayer.*``: EAGLE3, ``layers.0.*``:
        EAGLE-1); shapes, RoPE (``rope_theta``, 10000 when absent, and ``rope_scaling``) and
        the feature layers come from the draft's config.json; a missing ``embed_tokens``
        (and EAGLE-1's LM head) is the target's.  The target must return the features the
        draft reads: build it with ``aux_layers=eagle_checkpoint.feature_layers(directory,
        n_layers)``.  Anything the computation here does not implement is refused by name."""
        from dcp_compile.models.eagle_checkpoint import load_draft

        return load_draft(cls, directory, target, dtype=dtype, device=device)

    def share_target_weights(self, target: DraftHost) -> EagleDraft:
        """Use the target's token embedding (and, for EAGLE, its LM head), as EAGLE does."""
        self.embed.weight = target.get_input_embeddings().weight
        if self.cfg.kind == "eagle":
            self.head.weight = target.get_output_embeddings().weight
        return self

    @property
    def target_vocab_size(self) -> int:
        return self.cfg.target.vocab_size

    @property
    def feature_width(self) -> int:
        """Width of the target features the draft reads."""
        return self.cfg.feature_width

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target vocabulary ids of draft vocabulary ids."""
        return draft_ids + self.d2t[draft_ids] if self.cfg.kind == "eagle3" else draft_ids

    def _attention_input(self, tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream entering the layer and the attention's input."""
        embedded = self.embed(tokens)
        if self.cfg.kind == "eagle":
            hidden = self.fc(torch.cat([embedded, features], dim=-1))
            return hidden, hidden
        # The target's k*H features enter through fc; the draft's own H-wide output
        # hidden state (later steps) is used as it is.
        hidden = self.fc(features) if features.shape[-1] != self.embed.embedding_dim else features
        return hidden, torch.cat([self.embed_norm(embedded), self.hidden_norm(hidden)], dim=-1)

    def _finish(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + self.feed_forward(self.ffn_norm(h))
        return self.head(h if self.cfg.kind == "eagle" else self.norm(h)).float(), h

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, features: torch.Tensor, logits_at: torch.Tensor | None = None
    ):
        """``logits_at [B, K]``: logits and hidden states at those indices of each row only
        (``[B, K, V]``, ``[B, K, H]``), as a prefill chunk or a draft-extend needs."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        hidden, attn_in = self._attention_input(tokens, features)
        h = hidden + self.attention(attn_in, positions, cos, sin)
        return self._finish(h if logits_at is None else take_rows(h, logits_at))

    def forward_unrolled(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: ``steps`` chained draft steps over whole sequences, no cache.

        ``tokens [B, T]`` are the tokens one ahead of ``features [B, T, kH]`` (the
        target's features at positions ``0..T-1``).  Step ``j`` at base ``p`` stands at
        position ``p + j``: it reads the token at ``p + j + 1`` and the hidden state
        step ``j - 1`` produced at base ``p`` (step 0: the target's features), and
        attends to step 0's keys at positions ``<= p`` and to steps ``1..j``'s own keys
        at base ``p``: exactly what the chained draft sees at serving time, where the
        cache holds target-feature entries up to the last accepted token and the
        chain's own entries after it.  Returns each step's logits ``[B, T, V]``; step
        ``j`` at base ``p`` predicts the token at ``p + j + 2``.
        """
        B, T = tokens.shape
        base = torch.arange(T, device=tokens.device)
        causal = base[None, :] <= base[:, None]
        same_base = torch.eye(T, dtype=torch.bool, device=tokens.device)
        keys, values, logits_per_step = [], [], []
        hidden_in = features
        for j in range(steps):
            step_tokens = torch.nn.functional.pad(tokens[:, j:], (0, j))
            cos, sin = self.rope_cos[None, base + j], self.rope_sin[None, base + j]
            hidden, attn_in = self._attention_input(step_tokens, hidden_in)
            q, k, v = (t.transpose(1, 2) for t in self.attention.project(attn_in, cos, sin))
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal] + [same_base] * j, dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask, enable_gqa=True
            )
            logits, hidden_in = self._finish(hidden + self.attention.wo(out.transpose(1, 2).reshape(B, T, -1)))
            logits_per_step.append(logits)
        return logits_per_step
