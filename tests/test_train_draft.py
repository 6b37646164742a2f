"""``dcp-compile train-draft`` on the real SmolLM2 (the GGUF the README's test command
installs), at a few steps: the prompts and the vocabulary, the draft's starting point, the
written checkpoint read back by ``EagleDraft.from_pretrained`` through ``--draft``, resuming,
and the refusals.  How well a full run drafts is measured in BENCHMARKS.md, not here."""

import json

import pytest
import torch
from safetensors import safe_open

from dcp_compile.cli import main
from dcp_compile.commands import draft_training, loading
from dcp_compile.commands.chat_prompts import chat_prompts, evaluation_prompts
from dcp_compile.commands.draft_training import DraftTrainConfig, draft_vocabulary
from dcp_compile.hf.causal_lm import load_causal_lm

TINY = DraftTrainConfig(prompts=4, max_new_tokens=6, generate_batch=4, draft_vocab=512, steps=2, batch=2, max_len=160,
                        checkpoint_every=1)


@pytest.fixture(scope="module")
def trained(smollm2, tmp_path_factory):
    """One tiny run; returns its directory and the log lines."""
    out = tmp_path_factory.mktemp("draft") / "d"
    lines = []
    record = draft_training.train_draft("smollm2", out, cfg=TINY, progress=False, log=lines.append)
    return out, record, lines


def test_chat_prompts_are_fixed_and_held_out_prompts_are_others():
    train, again = chat_prompts("train", 12), chat_prompts("train", 12)
    held = chat_prompts("held_out", 12)
    assert train == again
    assert not set(train) & set(held)
    assert [p.split(" ")[0] for p in train[:4]] == ["Write", "Explain", "How", "Write"]
    assert "```python\n" in train[1] and "unit tests" in train[3]


def test_the_draft_vocabulary_is_the_eos_then_the_ids_used_most():
    conversations = [dict(prompt=[5, 5, 7], answer=[9, 9, 9, 2]), dict(prompt=[7], answer=[9, 1])]
    vocab = draft_vocabulary(conversations, 4, 16, frozenset({15}))
    assert vocab.tolist() == [5, 7, 9, 15]  # 15: the EOS, never seen; then 9 (x4), 7 (x2), 5 (x2)
    with pytest.raises(ValueError, match="larger than the target's vocabulary"):
        draft_vocabulary(conversations, 17, 16, frozenset())


def test_the_draft_starts_as_the_targets_exit_at_its_last_feature_layer(smollm2):
    """Step 0 of the untrained draft is the target's layer ``L-3`` on the target's own
    hidden state, then its final norm and LM head, over the draft vocabulary."""
    model = load_causal_lm(smollm2.path, device="cpu", dtype=torch.float32)
    aux = draft_training.check_target(model.config)
    vocab = torch.arange(0, 49152, 7)[:1024]
    draft = draft_training.build_draft(model, aux, vocab, TINY)
    tokens = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=tokens, output_hidden_states=True, use_cache=False)
        features = torch.cat([out.hidden_states[i] for i in aux], dim=-1)
        exit_logits = model.lm_head(model.model.norm(out.hidden_states[aux[-1] + 1]))[..., vocab]
        step0 = draft.forward_unrolled(tokens[:, 1:], features[:, :-1], 1)[0]
    torch.testing.assert_close(step0, exit_logits[:, :-1], rtol=1e-4, atol=1e-4)
    assert draft.to_target_ids(torch.arange(1024)).tolist() == vocab.tolist()


def test_the_written_draft_is_the_trained_one_read_through_draft(trained, smollm2):
    out, record, _ = trained
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    assert files == ["README.md", "config.json", "model.safetensors", "training.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 512
    assert config["rope_theta"] == 100000.0 and config["eos_token_id"] == 2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys()  # the target's, as published drafts leave it
        assert int(f.get_tensor("t2d").sum()) == 512
    trained_state = torch.load(out / "training" / "checkpoint.pt", weights_only=False)["draft"]
    target, draft = loading.load(loading.resolve("smollm2", str(out)), max_batch=1, max_seq_len=64)
    loaded = draft.state_dict()
    for name, value in trained_state.items():
        if name.startswith("attention.cache") or not value.is_floating_point():
            assert torch.equal(loaded[name], value), name
            continue
        torch.testing.assert_close(loaded[name], value.to(torch.bfloat16).float(), rtol=0, atol=0, msg=name)
    assert record["conversations"] == 4 and record["settings"]["steps"] == 2
    card = (out / "README.md").read_text()
    assert "4 chat prompts" in card and "512 ids" in card


def test_a_rerun_resumes_from_the_checkpoint_and_changed_settings_are_refused(trained):
    out, _, _ = trained
    before = (out / "model.safetensors").read_bytes()
    lines = []
    draft_training.train_draft("smollm2", out, cfg=TINY, overwrite=True, progress=False, log=lines.append)
    assert any("resuming at step 2 of 2" in line for line in lines)
    assert (out / "model.safetensors").read_bytes() == before
    with pytest.raises(ValueError, match="other settings.*steps: 2 -> 3"):
        draft_training.train_draft("smollm2", out, cfg=DraftTrainConfig(**{**TINY.__dict__, "steps": 3}),
                                   overwrite=True, progress=False)


def test_a_directory_holding_a_draft_is_refused_without_overwrite(trained, capsys):
    out, _, _ = trained
    before = (out / "config.json").read_text()
    with pytest.raises(SystemExit) as exit_info:
        main(["train-draft", "--model", "smollm2", "--out", str(out)])
    assert exit_info.value.code == 2
    assert "already holds a draft (config.json, model.safetensors)" in capsys.readouterr().err
    assert (out / "config.json").read_text() == before


@pytest.mark.parametrize("model, message", [
    ("tiny-code", "brings its own draft: `dcp-compile train` trains both"),
])
def test_a_pair_is_sent_to_train(model, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train-draft", "--model", model, "--out", str(tmp_path / "d")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def _config(family: str, **overrides):
    import transformers

    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=256)
    return getattr(transformers, family)(**{**base, **overrides})


@pytest.mark.parametrize("config, message", [
    (lambda: _config("LlamaConfig", num_hidden_layers=3), "has 3 layers, and needs at least 4"),
    (lambda: _config("MistralConfig", num_hidden_layers=6, sliding_window=16), "sliding-window attention"),
    (lambda: _config("DeepseekV3Config", num_hidden_layers=6, kv_lora_rank=16, q_lora_rank=None,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8), "multi-head latent attention"),
    (lambda: _config("LlamaConfig", num_hidden_layers=6, head_dim=32), "head_dim 32 x 4 heads != hidden_size 64"),
])
def test_a_model_whose_features_the_draft_cannot_read_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        draft_training.check_target(config())


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--draft-vocab", "-1")])
def test_nonpositive_settings_are_usage_errors(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train-draft", "--model", "smollm2", "--out", str(tmp_path / "d"), flag, value])
    assert exit_info.value.code == 2
    assert f"{flag} must be positive" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_eval_prompts_a_chat_model_with_held_out_chat_prompts(smollm2):
    chosen = evaluation_prompts(smollm2, 3)
    codec = loading.codec(smollm2)
    assert chosen["prompt_kind"] == "held-out chat prompts"
    assert chosen["prompts"] == [codec.chat_ids([{"role": "user", "content": p}]) for p in chat_prompts("held_out", 3)]
    assert chosen["stop_ids"] == sorted(codec.eos_ids) and chosen["stop_ids"]
