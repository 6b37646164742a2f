"""A Hugging Face model directory and a published draft in every command: the exact gate
at DCP=2 on the exported shipped pair, and the refusals of bad input, each a usage error
(exit 2, no traceback) before any rank starts."""

import json
import shutil

import pytest

from dcp_compile.cli import main
from tests.models import eagle_reference as ref

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The shipped pair in the published formats (``dcp-compile export``)."""
    out = tmp_path_factory.mktemp("exported") / "tiny-code"
    assert main(["export", "--model", "tiny-code", "--out", str(out)]) == 0
    return out


def test_gate_on_the_exported_hf_model_and_eagle3_draft_is_exact_at_dcp_2(exported, capsys):
    code = main(["gate", "--model", str(exported / "target"), "--draft", str(exported / "draft"), "--dcp", "2",
                 "--prompts", "4", "--batch", "4", "--max-new-tokens", "32", "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["passed"] and summary["rule"] == "exact"
    assert summary["token_identity_rate"] == 1.0 and summary["accept_counts_identical"]
    assert summary["dcp_size"] == 2 and summary["k"] == 4
    assert summary["accept_len_dcp"] > 2.0, "the trained draft keeps its acceptance through the published layout"


def test_an_hf_model_without_a_draft_decodes_one_token_per_step_at_dcp_2(exported, capsys):
    code = main(["gate", "--model", str(exported / "target"), "--dcp", "2", "--prompts", "2", "--batch", "2",
                 "--max-new-tokens", "12", "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["passed"] and summary["token_identity_rate"] == 1.0
    assert (summary["k"], summary["topk"], summary["draft_tokens"]) == (0, 1, 0)
    assert summary["histogram_dcp"] == [2 * 11], "every step emits the target's one token"


@pytest.mark.parametrize("command", ["demo", "gate", "serve"])
def test_a_tree_for_an_hf_model_without_a_draft_is_a_usage_error(command, exported, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--model", str(exported / "target"), "--topk", "2", "--draft-tokens", "6"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "--topk and --draft-tokens given, but --model" in err and "has no draft (one token per step)" in err
    assert "pass --draft DIR or drop --topk and --draft-tokens" in err


def test_export_refuses_a_directory_that_holds_files(exported, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--model", "tiny-code", "--out", str(exported)])
    assert exit_info.value.code == 2 and "is not an empty directory" in capsys.readouterr().err


def _draft(directory, **overrides):
    options = dict(target_dim=256, vocab=256, draft_vocab=256, heads=4, kv_heads=2, head_dim=None, intermediate=64,
                   embed=False, seed=0)
    ref.random_eagle3(directory, **{**options, **overrides})
    return directory


def _neither(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    return ["--model", str(tmp_path)]


def _no_weights(tmp_path, exported):
    shutil.copytree(exported / "target", tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    return ["--model", str(tmp_path / "m")]


def _sliding(tmp_path, exported):
    from transformers import MistralConfig

    MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=256, sliding_window=16).save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    return ["--model", str(tmp_path / "m")]


BAD_INPUT = {
    "neither format": (lambda t, e: _neither(t), "is neither format: it has no 'model_type'"),
    "no weight file": (_no_weights, "no weights in the model directory"),
    "family DCP does not shard": (_sliding, "sliding-window attention"),
    "missing draft": (lambda t, e: ["--model", str(e / "target"), "--draft", str(t / "none")],
                      "no draft checkpoint directory"),
    "draft of another width": (lambda t, e: ["--model", str(e / "target"), "--draft", str(_draft(t, target_dim=128))],
                               "reads features 384 wide, but this target gives 768"),
    "draft of another vocabulary": (lambda t, e: ["--model", str(e / "target"), "--draft", str(_draft(t, vocab=300))],
                                    "for a target vocabulary of 300 tokens"),
    "RoPE type": (lambda t, e: ["--model", str(e / "target"), "--draft",
                                str(_draft(t, extra_config={"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))],
                  "RoPE scaling of type 'yarn'"),
    "draft extension": (lambda t, e: ["--model", str(e / "target"), "--draft",
                                      str(_draft(t, extra_config={"norm_before_residual": True}))],
                        "norm_before_residual"),
    "a draft beside a pair": (lambda t, e: ["--model", "tiny-code", "--draft", str(e / "draft")],
                              "brings its own draft"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
@pytest.mark.parametrize("command", ["gate", "serve"])
def test_bad_model_input_is_a_usage_error_before_any_rank_starts(case, command, exported, tmp_path, capsys):
    make, message = BAD_INPUT[case]
    flags = make(tmp_path, exported)
    with pytest.raises(SystemExit) as exit_info:
        main([command, *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert message in err, err


def test_eval_needs_a_draft_for_an_hf_model(exported, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--model", str(exported / "target")])
    assert exit_info.value.code == 2 and "needs --draft DIR" in capsys.readouterr().err


def test_the_exported_pair_keeps_its_accept_length_through_the_published_route(exported):
    """The same held-out prompts through the native pair and through transformers' directory
    with the EAGLE3 checkpoint: the same accept counts, step for step in aggregate."""
    from dcp_compile.commands import loading, training

    options = dict(k=4, n_prompts=8, new_tokens=48, batch=8)
    native = training.measure_acceptance("tiny-code", **options)
    published = training.measure_acceptance(
        loading.resolve(str(exported / "target"), str(exported / "draft")), **options)
    assert published["accept_histogram"] == native["accept_histogram"]
    assert published["mean_accept_length"] == native["mean_accept_length"] > 2.5
