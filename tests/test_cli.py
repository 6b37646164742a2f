import json
import subprocess
import sys

import pytest
import torch

from dcp_compile.cli import main
from dcp_compile.runtime.launch import free_port


def run_demo(*args, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "dcp_compile.cli", "demo", *args], capture_output=True, text=True, timeout=timeout
    )


def check_summary(summary, dcp_size=2):
    assert summary["dcp_size"] == dcp_size
    assert summary["tokens_identical"] is True and summary["accept_counts_identical"] is True
    assert summary["accept_len"]["dcp"] == summary["accept_len"]["off"]
    # the shipped draft is trained: the target accepts most of its tokens
    assert summary["accept_len"]["dcp"] > 2.0
    assert summary["tokens_per_s"]["dcp"] > 0 and summary["tokens_per_s"]["off"] > 0


def test_demo_spawns_two_ranks_and_reports_parity():
    proc = run_demo("--json", "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    check_summary(summary)
    assert summary["new_tokens"] == [24, 24, 24]
    assert (summary["k"], summary["topk"], summary["draft_tokens"]) == (4, 1, 4), "the chain by default"
    for arm in ("dcp", "off"):  # the compile time, split: every part measured, none past the whole
        parts = summary["compile_breakdown"][arm]
        assert parts["graphs"] >= 4 and parts["lowering"] > 0 and parts["analysis"] > 0 and parts["rest"] > 0
        spent = parts["analysis"] + parts["passes"] + parts["lowering"]
        assert spent + parts["rest"] == pytest.approx(summary["compile_s"][arm])


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--dcp", "0"), "--dcp, --k and --max-new-tokens must be >= 1"),
        (("--k", "0"), "--dcp, --k and --max-new-tokens must be >= 1"),
        (("--temperature", "-1"), "--temperature must be >= 0"),
        (("--prompt", ""), "--prompt must not be empty"),
        (("--chunk-size", "0"), "--chunk-size must be >= 1, got 0"),
        (("--kv-tokens", "64"), "--kv-tokens >= 1 with a --page-size; got --page-size 0 and --kv-tokens 64"),
    ],
)
def test_demo_rejects_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_serve_rejects_an_admission_window_out_of_range(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--admission-window-ms", "-1"])
    assert exit_info.value.code == 2
    assert "--admission-window-ms must be in [0, 1000], got -1.0" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--page-size", "4"], "--page-size 4 on CPU needs --kv-tokens (the pool's tokens over the DCP group): only a "
                           "GPU's pool is sized from its free memory"),
    (["--kv-tokens", "512"], "--page-size must be >= 0, and --kv-tokens >= 0 and given with a --page-size; got "
                             "--page-size 0 and --kv-tokens 512"),
    (["--page-size", "4", "--kv-tokens", "512", "--max-seq-len", "1024"],
     "--max-seq-len 1024 is more than the pool's --kv-tokens 512"),
    (["--preemption"], "--preemption grows rows of a paged pool: give --page-size (and, on CPU, --kv-tokens)"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1], got 0.0"),
])
def test_serve_rejects_a_pool_that_cannot_hold_a_request(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("command, need", [("demo", 271), ("eval", 325)])
def test_a_pool_smaller_than_one_request_is_a_usage_error_on_the_ranks(command, need, capsys):
    """The longest prompt is known only on the ranks: the refusal still ends the command
    with status 2 and the numbers, not a rank's traceback."""
    fewer = ["--prompts", "2"] if command == "eval" else []
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--dcp", "1", "--page-size", "4", "--kv-tokens", "8", *fewer])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert (f"dcp-compile {command}: error: --kv-tokens 8 holds less than one request of these prompts, {need} "
            f"tokens") in err


TREE_REFUSALS = {
    "topk below 1": (("--topk", "0"), "--k 4 --topk 0 --draft-tokens 4: topk must be >= 1, got topk=0"),
    "fewer nodes than the depth": (("--draft-tokens", "3"), "draft_tokens=3 is below the depth k=4"),
    "more nodes than the tree holds": (("--topk", "2", "--draft-tokens", "15"),
                                       "(topk + (k - 1) * topk**2 = 14 candidates): set draft_tokens <= 14"),
}


@pytest.mark.parametrize("case", TREE_REFUSALS)
@pytest.mark.parametrize("command", ["demo", "gate", "eval", "serve", "plan"])
def test_a_tree_shape_no_tree_has_is_a_usage_error(command, case, capsys):
    flags, message = TREE_REFUSALS[case]
    extra = ["--gpu-gib", "80"] if command == "plan" else []
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--k", "4", *flags, *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert message in err, err


def test_a_tree_without_draft_tokens_verifies_the_default_nodes(capsys):
    assert main(["plan", "--k", "6", "--topk", "4", "--gpu-gib", "80"]) == 0
    assert "tree k=6 topk=4 draft_tokens=16" in capsys.readouterr().out


def test_eval_of_a_tree_names_its_shape_accepts_within_the_depth_and_is_the_same_under_tp(capsys):
    assert main(["eval", "--k", "4", "--topk", "2", "--draft-tokens", "6", "--prompts", "2",
                 "--max-new-tokens", "16", "--lowering", "aot_eager"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["k"], result["topk"], result["draft_tokens"]) == (4, 2, 6)
    # a step accepts 0..k draft tokens and emits one more
    histogram = result["accept_histogram"]
    assert len(histogram) == 4 + 1 and sum(histogram) == result["verify_steps"] > 0
    assert 1 <= result["mean_accept_length"] <= 4 + 1
    # The same measure with the target sharded TP 4 x DCP 2 over spawned ranks, its KV in a
    # pool of pages: fp32 decoding is exact, so every step accepts what it accepted on one rank.
    assert main(["eval", "--tp", "4", "--dcp", "2", "--k", "4", "--topk", "2", "--draft-tokens", "6", "--prompts",
                 "2", "--max-new-tokens", "16", "--lowering", "aot_eager", "--page-size", "4"]) == 0
    sharded = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sharded.pop("layout") == "TP 4 x DCP 2" and result.pop("layout") == "DCP 1"
    assert sharded.pop("kv_pool_tokens") > 0 and "kv_pool_tokens" not in result
    assert sharded == result


@pytest.mark.parametrize("command", ["demo", "gate", "eval", "serve", "plan"])
def test_a_model_that_names_no_checkpoint_is_a_usage_error(command, tmp_path, capsys):
    """Refused in the command's own process with the choices, not as a traceback from a
    spawned rank or a half-started server."""
    extra = ["--gpu-gib", "80"] if command == "plan" else []
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--model", str(tmp_path / "nowhere"), *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert f"--model '{tmp_path / 'nowhere'}': no checkpoint directory at" in err
    assert "shipped name (tiny-code)" in err and "dcp-compile train --out DIR" in err
    assert ("one of the shapes llama3-8b, deepseek-v2-lite, deepseek-v3" in err) == (command == "plan")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine with no CUDA device")
@pytest.mark.parametrize("command", ["demo", "gate", "eval", "serve", "train"])
def test_cuda_where_there_is_none_is_a_usage_error(command, tmp_path, capsys):
    extra = ["--out", str(tmp_path / "ckpt")] if command == "train" else []
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--device", "cuda", *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--device cuda: torch" in err and "sees no CUDA device here" in err
    assert "pass --device cpu" in err and not (tmp_path / "ckpt").exists()


def test_a_checkpoint_whose_config_is_not_a_pair_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"target": {}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--model", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "does not describe a target and draft" in capsys.readouterr().err


def test_demo_runs_as_one_rank_under_torchrun_and_only_rank_0_talks():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "dcp_compile.cli", "demo", "--max-new-tokens", "8", "--k", "2", "--prompt", "def f(x):\n",
         "--page-size", "4", "--kv-tokens", "48"],  # both arms' targets paged
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "DCP arm: group of 2 (gloo, cpu)" in out
    assert "--- prompt 0, streamed from the DCP arm ---\ndef f(x):\n" in out
    assert "tokens identical = True, accept counts identical = True" in out
    assert out.count("DCP arm (size 2)") == 1 and out.count("off arm (size 1)") == 1, "only rank 0 reports"


@pytest.mark.parametrize("argv, message", [
    (["demo", "--tp", "4", "--dcp", "3"], "--tp 4 --dcp 3: DCP size 3 does not divide TP size 4"),
    (["gate", "--tp", "0"], "--tp must be >= 1, got 0"),
    (["serve", "--tp", "6", "--dcp", "4"], "DCP size 4 does not divide TP size 6"),
    (["plan", "--tp", "4", "--dcp", "1,3", "--gpu-gib", "80"], "--tp 4: DCP sizes [3] do not divide it"),
])
def test_tp_layouts_that_cannot_be_laid_out_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_tp_under_a_torchrun_world_of_another_size_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--tp", "4", "--dcp", "2"])
    assert exit_info.value.code == 2
    assert "--tp 4 needs a world of 4 ranks (one TP group), but torchrun started 2" in capsys.readouterr().err


@pytest.mark.parametrize("family, options, found", [
    ("Qwen2Config", {}, "model_type 'qwen2' (not 'llama')"),
    ("LlamaConfig", {"attention_bias": True}, "attention_bias=True"),
    ("LlamaConfig", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "RoPE scaling of type 'yarn'"),
])
def test_tp_of_a_hugging_face_model_llama_does_not_compute_names_the_route_that_works(family, options, found, tmp_path,
                                                                                       capsys):
    """A Hugging Face Llama loads as the package's Llama under --tp (test_gguf: SmolLM2 at
    --tp 3); any other model is refused by what does not fit, with the route."""
    import argparse
    from types import SimpleNamespace

    import transformers

    from dcp_compile.commands import parallel

    getattr(transformers, family)(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                  intermediate_size=64, vocab_size=256, **options).save_pretrained(tmp_path)
    parser = argparse.ArgumentParser(prog="dcp-compile")
    with pytest.raises(SystemExit):
        parallel.check_tp(parser, SimpleNamespace(tp=2, dcp=1, device="cpu"), SimpleNamespace(kind="hf", path=tmp_path))
    err = capsys.readouterr().err
    assert found in err and "serve it with --dcp alone" in err and "shards this package's own Llama" in err


def test_plan_prices_a_rank_of_tp(capsys):
    assert main(["plan", "--model", "deepseek-v2-lite", "--tp", "4", "--dcp", "1,4", "--gpu-gib", "80", "--k", "0"]) == 0
    whole = capsys.readouterr().out
    assert main(["plan", "--model", "deepseek-v2-lite", "--dcp", "1,4", "--gpu-gib", "80", "--k", "0"]) == 0
    assert "weights 1.8 GiB per GPU at TP 4" in whole and "weights 4.9 GiB per GPU," in capsys.readouterr().out
