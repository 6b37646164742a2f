"""``EagleDraft.from_pretrained`` against an independent implementation of the official
EAGLE3 and EAGLE-1 forwards (``eagle_reference``), on random checkpoints in the published
layouts; and the refusals of what it does not compute."""

import json

import pytest
import torch

from dcp_compile.models import EagleDraft, Llama, LlamaConfig
from dcp_compile.models.eagle_checkpoint import feature_layers
from dcp_compile.models.llama import init_weights
from tests.models import eagle_reference as ref

TOLERANCE = dict(atol=1e-5, rtol=1e-5)
T, B = 12, 2
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
"""A llama3 scaling whose bands all fall inside a short test sequence's frequencies."""


def target_for(directory, *, dim=32, vocab=96, n_layers=6, seed=0) -> Llama:
    cfg = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2, intermediate_size=64,
                      max_seq_len=32, max_batch=B, aux_layers=feature_layers(directory, n_layers))
    return init_weights(Llama(cfg), seed).eval()


def draft_outputs(draft, tokens, features):
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape)
    with torch.no_grad():
        return draft(tokens, positions, features)


def inputs(vocab, width, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=gen), torch.randn(B, T, width, generator=gen)


def on_target_ids(logits, draft):
    """The draft's logits scattered over the target vocabulary (-inf elsewhere), as the
    engines compute them."""
    full = torch.full((*logits.shape[:-1], draft.target_vocab_size), float("-inf"))
    full[..., draft.to_target_ids(torch.arange(logits.shape[-1]))] = logits
    return full


EAGLE3_CASES = {
    "published Llama-3.1-8B form: theta 10000 by default, own head, no embed_tokens": dict(
        draft_vocab=96, heads=4, kv_heads=2, head_dim=None, embed=False, extra={}),
    "draft vocabulary with d2t, own embed_tokens": dict(
        draft_vocab=40, heads=4, kv_heads=2, head_dim=None, embed=True, extra={"rope_theta": 500000.0}),
    "llama3 scaling, head_dim not hidden/heads (70B-draft form)": dict(
        draft_vocab=40, heads=4, kv_heads=1, head_dim=12, embed=False,
        extra={"rope_theta": 50.0, "rope_scaling": LLAMA3}),
    "transformers-5 rope_parameters, linear scaling, pytorch_model.bin": dict(
        draft_vocab=96, heads=2, kv_heads=2, head_dim=None, embed=False, fmt="bin",
        extra={"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0}}),
    "a draft wider than its target (target_hidden_size), own embedding": dict(
        draft_vocab=40, heads=4, kv_heads=2, head_dim=None, embed=True, dim=48, extra={"rope_theta": 30.0}),
}


def loaded_case(directory, case):
    """A random checkpoint of ``case`` read by ``from_pretrained``, with its inputs."""
    c = EAGLE3_CASES[case]
    sd, config = ref.random_eagle3(directory, target_dim=32, vocab=96, draft_vocab=c["draft_vocab"], heads=c["heads"],
                                   kv_heads=c["kv_heads"], head_dim=c["head_dim"], intermediate=80, embed=c["embed"],
                                   seed=3, extra_config=c["extra"], fmt=c.get("fmt", "safetensors"), dim=c.get("dim"))
    target = target_for(directory)
    draft = EagleDraft.from_pretrained(directory, target).eval()
    tokens, features = inputs(96, 3 * 32)
    embed = sd.get("embed_tokens.weight", target.tok_embeddings.weight.detach())
    return c, sd, config, target, draft, tokens, features, embed


@pytest.mark.parametrize("case", EAGLE3_CASES)
def test_eagle3_checkpoint_matches_the_official_forward(tmp_path, case):
    c, sd, config, target, draft, tokens, features, embed = loaded_case(tmp_path, case)
    with torch.no_grad():
        expected_logits, expected_hidden = ref.eagle3_forward(sd, config, embed, tokens, features)
    logits, hidden = draft_outputs(draft, tokens, features)
    torch.testing.assert_close(on_target_ids(logits, draft), expected_logits, **TOLERANCE)
    torch.testing.assert_close(hidden, expected_hidden, **TOLERANCE)
    # The draft's own h feeds its next step, as the official chain does.
    with torch.no_grad():
        second, _ = draft(tokens, torch.arange(T).expand(B, T), hidden)
    assert second.shape == logits.shape and torch.isfinite(second).all()
    if not c["embed"]:
        assert draft.embed.weight is target.tok_embeddings.weight, "the target's embedding, shared, not copied"


def _perturbed(config: dict) -> dict:
    """The same config with its RoPE setting dropped: what a loader that ignored it computes."""
    config = dict(config)
    config.pop("rope_scaling", None)
    config.pop("rope_parameters", None)
    config["rope_theta"] = 10000.0 if config.get("rope_theta", 10000.0) != 10000.0 else 500000.0
    return config


@pytest.mark.parametrize("case", EAGLE3_CASES)
def test_each_rope_setting_changes_the_logits(tmp_path, case):
    """The fidelity test can fail: the reference with the checkpoint's RoPE setting dropped
    (or the rows left in rotate-half order) is far from the loaded draft."""
    c, sd, config, target, draft, tokens, features, embed = loaded_case(tmp_path, case)
    logits, _ = draft_outputs(draft, tokens, features)
    got = on_target_ids(logits, draft)
    with torch.no_grad():
        wrong_rope, _ = ref.eagle3_forward(sd, _perturbed(config), embed, tokens, features)
        draft.attention.wq.weight.copy_(sd["midlayer.self_attn.q_proj.weight"])
        draft.attention.wk.weight.copy_(sd["midlayer.self_attn.k_proj.weight"])
        as_is, _ = draft_outputs(draft, tokens, features)
        expected, _ = ref.eagle3_forward(sd, config, embed, tokens, features)
    finite = torch.isfinite(expected)
    assert (got[finite] - wrong_rope[finite]).abs().max() > 1e-3
    assert (on_target_ids(as_is, draft)[finite] - expected[finite]).abs().max() > 1e-3


@pytest.mark.parametrize("bias, embed", [(True, True), (False, False)])
def test_eagle1_checkpoint_matches_the_official_forward(tmp_path, bias, embed):
    sd, config = ref.random_eagle1(tmp_path, dim=32, vocab=96, heads=4, kv_heads=2, intermediate=80, bias=bias,
                                   embed=embed, seed=4, extra_config={"rope_theta": 500000.0})
    target = target_for(tmp_path)
    assert target.cfg.aux_layers == (6,), "EAGLE-1 reads the target's final normed hidden state"
    draft = EagleDraft.from_pretrained(tmp_path, target).eval()
    assert (draft.fc.bias is not None) == bias
    tokens, features = inputs(96, 32)
    with torch.no_grad():
        expected_logits, expected_hidden = ref.eagle1_forward(
            sd, config, target.tok_embeddings.weight, target.output.weight, tokens, features)
    logits, hidden = draft_outputs(draft, tokens, features)
    torch.testing.assert_close(logits, expected_logits, **TOLERANCE)
    torch.testing.assert_close(hidden, expected_hidden, **TOLERANCE)
    assert draft.head.weight is target.output.weight


def test_feature_layers_follow_each_sources_convention(tmp_path):
    ref.random_eagle3(tmp_path / "default", target_dim=32, vocab=96, draft_vocab=96, heads=4, kv_heads=2,
                      head_dim=None, intermediate=80, embed=False, seed=0)
    assert feature_layers(tmp_path / "default", 32) == (2, 16, 29)
    ref.random_eagle3(tmp_path / "vllm", target_dim=32, vocab=96, draft_vocab=96, heads=4, kv_heads=2, head_dim=None,
                      intermediate=80, embed=False, seed=0, extra_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]})
    assert feature_layers(tmp_path / "vllm", 8) == (1, 3, 5), "top-level ids are layer inputs"
    ref.random_eagle3(tmp_path / "sglang", target_dim=32, vocab=96, draft_vocab=96, heads=4, kv_heads=2, head_dim=None,
                      intermediate=80, embed=False, seed=0,
                      extra_config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}})
    assert feature_layers(tmp_path / "sglang", 8) == (2, 4, 6), "eagle_config ids are layer outputs"
    ref.random_eagle3(tmp_path / "both", target_dim=32, vocab=96, draft_vocab=96, heads=4, kv_heads=2, head_dim=None,
                      intermediate=80, embed=False, seed=0,
                      extra_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5],
                                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}})
    with pytest.raises(ValueError, match="the two disagree"):
        feature_layers(tmp_path / "both", 8)


def _eagle3(directory, **overrides):
    options = dict(target_dim=32, vocab=96, draft_vocab=40, heads=4, kv_heads=2, head_dim=None, intermediate=80,
                   embed=False, seed=0)
    return ref.random_eagle3(directory, **{**options, **overrides})


def _edit(directory, *, config=None, drop=(), add=None):
    from safetensors.torch import load_file, save_file

    if config is not None:
        path = directory / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if drop or add:
        state = load_file(str(directory / "model.safetensors"))
        state = {k: v for k, v in state.items() if k not in drop}
        save_file({**state, **(add or {})}, str(directory / "model.safetensors"))


REFUSALS = {
    "fc width": (dict(n_features=2), None, r"fc in .* reads features 64 wide, but this target gives 96 \(3 features x 32\)"),
    "d2t outside": (dict(), dict(add={"d2t": torch.full((40,), 90, dtype=torch.long)}),
                    r"maps 34 of its 40 tokens outside the target vocabulary \[0, 96\)"),
    "no d2t": (dict(), dict(drop=("d2t",)), "has a vocabulary of 40 tokens but no d2t map"),
    "missing norm": (dict(), dict(drop=("norm.weight",)), r"lacks \['norm.weight'\]"),
    "fc_norm flag": (dict(), dict(config={"fc_norm": True}), r"fc_norm \(a per-feature RMSNorm before fc"),
    "fc_norm weights": (dict(), dict(add={"fc_norm.0.weight": torch.ones(32)}), "fc_norm weights"),
    "norm_before_residual": (dict(), dict(config={"norm_before_residual": True}), "norm_before_residual"),
    "two layers": (dict(), dict(config={"num_hidden_layers": 2}), "more than one draft layer"),
    "yarn": (dict(), dict(config={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
             "RoPE scaling of type 'yarn', which this package does not implement"),
    "other vocabulary": (dict(vocab=128), None, "for a target vocabulary of 128 tokens .vocab_size., but this target has 96"),
    "shape": (dict(), dict(add={"midlayer.mlp.up_proj.weight": torch.ones(81, 32)}), r"midlayer.mlp.up_proj.weight .* is \(81, 32\), but its config.json gives \(80, 32\)"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_name_what_is_wrong(tmp_path, case):
    overrides, edit, message = REFUSALS[case]
    _eagle3(tmp_path, **overrides)
    if edit:
        _edit(tmp_path, **edit)
    cfg = LlamaConfig(vocab_size=96, dim=32, n_layers=6, n_heads=4, n_kv_heads=2, intermediate_size=64,
                      max_seq_len=32, max_batch=B, aux_layers=(0, 2, 3))
    target = Llama(cfg).eval()
    with pytest.raises(ValueError, match=message):
        EagleDraft.from_pretrained(tmp_path, target)


def test_a_target_without_the_drafts_features_is_told_the_fix(tmp_path):
    _eagle3(tmp_path)
    target = Llama(LlamaConfig(vocab_size=96, dim=32, n_layers=6, n_heads=4, n_kv_heads=2, max_batch=B,
                               aux_layers=(1, 2, 3))).eval()
    with pytest.raises(ValueError, match=r"reads the target's hidden states at layers \(0, 2, 3\).*returns \(1, 2, 3\)"):
        EagleDraft.from_pretrained(tmp_path, target)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no draft checkpoint directory"):
        feature_layers(tmp_path / "nowhere", 6)
    tmp_path.joinpath("config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="expected model.safetensors or pytorch_model.bin"):
        feature_layers(tmp_path, 6)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        feature_layers(tmp_path, 6)
