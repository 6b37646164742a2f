"""The training paths compute what serving computes, and the trainer runs end to end."""

import json

import pytest
import torch

from dcp_compile.commands import training
from dcp_compile.models import DraftConfig, EagleDraft, LlamaConfig, eagle3_aux_layers
from dcp_compile.models.llama import init_weights
from dcp_compile.models.pretrained import load_config, load_pair
from tests.support import FP32_TOLERANCE, make_model


def test_uncached_forward_equals_the_cached_forward_from_position_zero():
    cfg = LlamaConfig(n_layers=3, max_batch=2, aux_layers=(1, 3))
    model = make_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, aux = model(tokens, torch.arange(9).expand(2, 9))
        logits_u, aux_u = model.forward_uncached(tokens)
    torch.testing.assert_close(logits_u, logits, **FP32_TOLERANCE)
    torch.testing.assert_close(aux_u, aux, **FP32_TOLERANCE)


def test_unrolled_draft_equals_the_cached_chain_at_every_base_position():
    cfg = LlamaConfig(n_layers=4, max_batch=1, max_seq_len=16, aux_layers=eagle3_aux_layers(4))
    draft = init_weights(EagleDraft(DraftConfig(cfg, "eagle3")), seed=3).eval()
    gen = torch.Generator().manual_seed(1)
    T, steps = 8, 3
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=gen)
    features = torch.randn(1, T, len(cfg.aux_layers) * cfg.dim, generator=gen)
    with torch.no_grad():
        unrolled = draft.forward_unrolled(tokens, features, steps)
        for p in range(T - steps + 1):
            draft.attention.k_cache.zero_()
            draft.attention.v_cache.zero_()
            logits, hidden = draft(tokens[:, : p + 1], torch.arange(p + 1)[None], features[:, : p + 1])
            chain = [logits[:, p]]
            hidden = hidden[:, p : p + 1]
            for j in range(1, steps):
                logits, hidden = draft(tokens[:, p + j : p + j + 1], torch.tensor([[p + j]]), hidden)
                chain.append(logits[:, 0])
            for j in range(steps):
                torch.testing.assert_close(unrolled[j][:, p], chain[j], **FP32_TOLERANCE, msg=f"step {j} base {p}")


def test_held_out_split_is_a_fixed_rule_on_relative_paths():
    held = training.corpus_files("held_out")
    train = training.corpus_files("train")
    root = training.stdlib_root()
    assert held and train and not set(held) & set(train)
    assert all(training.is_held_out(p.relative_to(root).as_posix()) for p in held)
    assert 0.02 < len(held) / (len(held) + len(train)) < 0.10
    with pytest.raises(ValueError, match="split must be"):
        training.corpus_files("test")


def test_smoke_training_writes_a_loadable_pair_whose_loss_went_down(tmp_path):
    cfg = training.preset("smoke")
    record = training.train(cfg, tmp_path, torch.device("cpu"), progress=False, log=lambda *_: None)
    history = json.loads((tmp_path / "history.json").read_text())
    assert history["target"][-1][1] < history["target"][0][1]
    assert len(record["final"]["draft_step_losses"]) == cfg.ttt_steps
    assert load_config(tmp_path)["training"]["final"] == record["final"], "config.json carries what training measured"
    target, draft = load_pair(tmp_path, max_batch=2, max_seq_len=32)
    assert target.cfg.dim == cfg.dim and target.cfg.max_seq_len == 32 and draft.cfg.kind == "eagle3"
    torch.testing.assert_close(draft.embed.weight, target.tok_embeddings.weight)


def test_loading_a_directory_without_weights_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        load_pair(tmp_path / "nowhere", max_batch=1, max_seq_len=8)
    (tmp_path / "config.json").write_text(json.dumps(dict(target=dict(), draft=dict(kind="eagle3"))))
    with pytest.raises(FileNotFoundError, match="target.safetensors is missing"):
        load_pair(tmp_path, max_batch=1, max_seq_len=8)
