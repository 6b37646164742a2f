"""The exported tiny-code pair: transformers runs the target as the native model does, the
tokenizer is the byte identity, and the draft has exactly the published EAGLE3 tensors."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402

from dcp_compile.commands.export import CHAT_TEMPLATE, _feature_layer_keys, export_pair, gpt2_byte_chars  # noqa: E402
from dcp_compile.models.eagle import DraftConfig, EagleDraft  # noqa: E402
from dcp_compile.models.llama import Llama, LlamaConfig, apply_rope, init_weights, rope_tables  # noqa: E402
from dcp_compile.models.pretrained import load_pair, save_pair  # noqa: E402
from dcp_compile.models.rope_layout import interleaved_to_rotate_half, rotate_half_to_interleaved  # noqa: E402

LOGIT_ATOL = 1e-4
"""fp32 on both sides over the same bf16 weights: what is left is summation order and
transformers' fp32 RoPE tables against the native float64-built ones."""

PROMPTS = [
    b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    b"import os\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = os.path",
    b"    for key, value in sorted(items.items()):\n        if value is None:\n",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny-code"
    return out, export_pair("tiny-code", out)


@pytest.fixture(scope="module")
def native():
    target, draft = load_pair("tiny-code", max_batch=1, max_seq_len=128)
    return target, draft


@pytest.fixture(scope="module")
def hf_target(exported):
    out, _ = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32,
                                                              attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(exported):
    return transformers.AutoTokenizer.from_pretrained(exported[0] / "target")


def ids(prompt: bytes) -> torch.Tensor:
    return torch.tensor([list(prompt)])


# --- the RoPE permutation ---------------------------------------------------------------

def test_the_permutations_are_inverse_and_move_rows_within_heads():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4 * 8, 5, generator=gen)
    to_hf = interleaved_to_rotate_half(w, 4)
    assert torch.equal(rotate_half_to_interleaved(to_hf, 4), w)
    assert torch.equal(interleaved_to_rotate_half(rotate_half_to_interleaved(w, 4), 4), w)
    # head 1 (rows 8..15), hd 8: native row 2i + c is Hugging Face row c * 4 + i
    for i in range(4):
        for c in range(2):
            assert torch.equal(to_hf[8 + c * 4 + i], w[8 + 2 * i + c])
    with pytest.raises(ValueError, match="even width"):
        interleaved_to_rotate_half(torch.zeros(12, 3), 4)


def test_rotate_half_rope_on_hf_rows_is_native_rope_on_the_permuted_rows():
    """transformers' RoPE written out (q * cos + rotate_half(q) * sin over cat(freqs, freqs))."""
    B, T, H, hd = 2, 7, 3, 16
    q_hf = torch.randn(B, T, H * hd, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_tables(hd, T, 10000.0)  # [T, hd/2]
    cos_full, sin_full = torch.cat([cos, cos], -1)[None, :, None], torch.cat([sin, sin], -1)[None, :, None]
    x = q_hf.view(B, T, H, hd)
    rotate_half = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1)
    hf_rotated = (x * cos_full + rotate_half * sin_full).reshape(B, T, H * hd)

    def rows(f, t):  # the permutations act on rows: the feature axis goes first
        return f(t.reshape(-1, H * hd).T, H).T.reshape(t.shape)

    native = apply_rope(rows(rotate_half_to_interleaved, q_hf).view(B, T, H, hd), cos[None], sin[None])
    back = rows(interleaved_to_rotate_half, native.reshape(B, T, H * hd))
    torch.testing.assert_close(back, hf_rotated, rtol=0, atol=1e-6)


# --- the target under transformers -------------------------------------------------------

def test_transformers_logits_equal_the_native_model(hf_target, native):
    target, _ = native
    with torch.no_grad():
        for prompt in PROMPTS:
            assert 40 <= len(prompt) <= 100
            expected, _ = target.forward_uncached(ids(prompt))
            got = hf_target(input_ids=ids(prompt)).logits
            torch.testing.assert_close(got, expected, rtol=0, atol=LOGIT_ATOL)


def test_without_the_rope_permutation_the_logits_differ(hf_target, native, exported):
    """The check above can fail: q/k rows left in the native layout change the logits."""
    target, _ = native
    unpermuted = transformers.AutoModelForCausalLM.from_pretrained(exported[0] / "target", dtype=torch.float32)
    cfg = unpermuted.config
    with torch.no_grad():
        for layer in unpermuted.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.copy_(rotate_half_to_interleaved(attn.q_proj.weight, cfg.num_attention_heads))
            attn.k_proj.weight.copy_(rotate_half_to_interleaved(attn.k_proj.weight, cfg.num_key_value_heads))
        expected, _ = target.forward_uncached(ids(PROMPTS[0]))
        wrong = unpermuted(input_ids=ids(PROMPTS[0])).logits
    assert (wrong - expected).abs().max() > 100 * LOGIT_ATOL


def test_transformers_greedy_generate_matches_the_native_argmax_loop(hf_target, native, tokenizer):
    target, _ = native
    prompt = PROMPTS[1]
    tokens = ids(prompt)
    with torch.no_grad():
        for _ in range(16):
            logits, _ = target.forward_uncached(tokens)
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
        encoded = tokenizer(prompt.decode(), return_tensors="pt")
        generated = hf_target.generate(**encoded, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert generated[0].tolist() == tokens[0].tolist()


def test_target_config_reads_back(exported):
    config = transformers.AutoConfig.from_pretrained(exported[0] / "target")
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    assert config.rope_parameters["rope_theta"] == 10000.0 and config.rope_parameters["rope_type"] == "default"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size) == (256, 256, 8, 4, 2, 64, 768)
    assert config.eos_token_id == 0 and config.bos_token_id is None and config.tie_word_embeddings is False
    assert transformers.GenerationConfig.from_pretrained(exported[0] / "target").eos_token_id == 0
    weights = load_file(str(exported[0] / "target" / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


# --- the tokenizer ---------------------------------------------------------------------

def test_the_byte_chars_are_the_bytelevel_alphabet():
    chars = gpt2_byte_chars()
    assert len(chars) == 256 and set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    bytelevel = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    text = "".join(map(chr, range(128))) + "é€😀"
    assert bytelevel.pre_tokenize_str(text)[0][0] == "".join(chars[b] for b in text.encode())


TEXTS = [
    "def f(x):\n\treturn x  # done\r\n",
    "Ā is U+0100, not byte 0; ÿ é ß ü — “quotes” € 日本語 😀 \u2028 \ufeff",
    "".join(map(chr, range(256))),  # every control character and all of Latin-1
    "a\x00b\x00\x00",
    " . , 's n't  ",  # would be altered by clean_up_tokenization_spaces
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_encodes_utf8_bytes_and_decodes_back(tokenizer, text):
    encoded = tokenizer(text)["input_ids"]
    assert encoded == list(text.encode("utf-8"))  # and no BOS
    assert tokenizer.decode(encoded) == text
    assert tokenizer.decode(encoded, skip_special_tokens=True) == text.replace("\x00", "")


def _utf8_context(b: int) -> list[int]:
    """A shortest valid UTF-8 sequence containing byte ``b``; ``[b]`` where none exists."""
    if b < 0x80:
        return [b]
    if b < 0xC0:
        return [0xC2, b]  # a continuation byte
    if 0xC2 <= b < 0xE0:
        return [b, 0x80]
    if 0xE0 <= b < 0xF0:
        return [b, 0xA0 if b == 0xE0 else 0x80, 0x80]
    if 0xF0 <= b < 0xF5:
        return [b, 0x90 if b == 0xF0 else 0x80, 0x80, 0x80]
    return [b]  # C0, C1, F5..FF: never in UTF-8


def test_every_byte_id_decodes_to_its_byte(tokenizer):
    chars = gpt2_byte_chars()
    assert tokenizer.convert_ids_to_tokens(list(range(1, 256))) == list(chars[1:])
    assert tokenizer.convert_ids_to_tokens(0) == "\x00" and tokenizer.eos_token_id == 0 == tokenizer.pad_token_id
    assert tokenizer.bos_token_id is None
    for b in range(256):
        context = _utf8_context(b)
        expected = bytes(context).decode("utf-8", errors="replace")
        assert tokenizer.decode(context) == expected, (b, context)
        assert b in (0xC0, 0xC1) or b >= 0xF5 or "\ufffd" not in expected


def test_chat_template_renders_the_code_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "Sort a list.\nKeep it stable.\n"},
        {"role": "user", "content": "def sort(xs):\n"},
        {"role": "assistant", "content": "    return sorted(xs)\n"},
        {"role": "user", "content": "\ndef main():\n"},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "# Sort a list.\n# Keep it stable.\ndef sort(xs):\n    return sorted(xs)\n\ndef main():\n"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False) == rendered
    assert tokenizer.chat_template == CHAT_TEMPLATE


# --- the draft -------------------------------------------------------------------------

H, I, NH, NKV, HD, V = 256, 768, 4, 2, 64, 256
EAGLE3_TENSORS = {
    "fc.weight": ((H, 3 * H), torch.bfloat16),
    "midlayer.input_layernorm.weight": ((H,), torch.bfloat16),
    "midlayer.hidden_norm.weight": ((H,), torch.bfloat16),
    "midlayer.self_attn.q_proj.weight": ((NH * HD, 2 * H), torch.bfloat16),
    "midlayer.self_attn.k_proj.weight": ((NKV * HD, 2 * H), torch.bfloat16),
    "midlayer.self_attn.v_proj.weight": ((NKV * HD, 2 * H), torch.bfloat16),
    "midlayer.self_attn.o_proj.weight": ((H, NH * HD), torch.bfloat16),
    "midlayer.post_attention_layernorm.weight": ((H,), torch.bfloat16),
    "midlayer.mlp.gate_proj.weight": ((I, H), torch.bfloat16),
    "midlayer.mlp.up_proj.weight": ((I, H), torch.bfloat16),
    "midlayer.mlp.down_proj.weight": ((H, I), torch.bfloat16),
    "norm.weight": ((H,), torch.bfloat16),
    "lm_head.weight": ((V, H), torch.bfloat16),
    "d2t": ((V,), torch.int64),
    "t2d": ((V,), torch.bool),
}


def test_draft_has_exactly_the_published_eagle3_tensors(exported, native):
    out, report = exported
    _, draft = native
    weights = load_file(str(out / "draft" / "model.safetensors"))
    assert {k: (tuple(t.shape), t.dtype) for k, t in weights.items()} == EAGLE3_TENSORS  # no embed_tokens
    assert not report["draft_embed_tokens"]
    q, k = weights["midlayer.self_attn.q_proj.weight"], weights["midlayer.self_attn.k_proj.weight"]
    assert torch.equal(q.float(), interleaved_to_rotate_half(draft.attention.wq.weight, NH))
    assert torch.equal(k.float(), interleaved_to_rotate_half(draft.attention.wk.weight, NKV))
    assert not torch.equal(q.float(), draft.attention.wq.weight)
    assert torch.equal(weights["midlayer.self_attn.v_proj.weight"].float(), draft.attention.wv.weight)
    assert torch.equal(weights["midlayer.input_layernorm.weight"].float(), draft.embed_norm.weight)
    assert torch.equal(weights["midlayer.post_attention_layernorm.weight"].float(), draft.ffn_norm.weight)
    assert torch.equal(weights["midlayer.mlp.gate_proj.weight"].float(), draft.feed_forward.w1.weight)
    assert torch.equal(weights["lm_head.weight"].float(), draft.head.weight)
    assert not weights["d2t"].any() and weights["t2d"].all()
    assert report["draft_parameters"] == sum(t.numel() for t in weights.values() if t.is_floating_point())


def test_the_package_reads_the_exported_draft_back_bitwise(exported, native):
    """``EagleDraft.from_pretrained`` (the published-format reader) undoes the export."""
    target, draft = native
    back = EagleDraft.from_pretrained(exported[0] / "draft", target)
    expected, got = draft.state_dict(), back.state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def test_draft_config_is_the_published_eagle3_config(exported):
    config = json.loads((exported[0] / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["vocab_size"], config["draft_vocab_size"]) == (1, 256, 256)
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["intermediate_size"]) == (H, NH, NKV, HD, I)
    assert config["rope_theta"] == 10000.0 and config["bias"] is False and config["tie_word_embeddings"] is False
    assert "eagle_aux_hidden_state_layer_ids" not in config  # layers 2, 4, 5 are the published default for L=8
    read = transformers.LlamaConfig.from_pretrained(exported[0] / "draft")
    assert read.rope_parameters["rope_theta"] == 10000.0 and read.num_hidden_layers == 1


def test_feature_layers_other_than_the_default_are_named_in_both_conventions():
    assert _feature_layer_keys((2, 16, 29), 32) == {}
    assert _feature_layer_keys((3, 6, 9), 12) == {
        "eagle_aux_hidden_state_layer_ids": [3, 6, 9],  # vLLM: layer inputs
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 5, 8]},  # SGLang: layer outputs
    }
    with pytest.raises(ValueError, match="input 0"):
        _feature_layer_keys((0, 1, 2), 4)  # the embedding cannot be named as a layer's output
    with pytest.raises(ValueError, match="three layers"):
        _feature_layer_keys((1, 2, 3, 4), 12)


def test_a_trained_pair_with_its_own_draft_embedding_and_feature_layers(tmp_path):
    """A `dcp-compile train` directory: a draft embedding unlike the target's is written
    (loaders would otherwise take the target's), other feature layers are named."""
    cfg = LlamaConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=48, rope_theta=500.0,
                      aux_layers=(1, 2, 3))
    target = init_weights(Llama(cfg), seed=0)
    draft = init_weights(EagleDraft(DraftConfig(cfg)), seed=1)
    save_pair(tmp_path / "pair", target, draft)
    report = export_pair(tmp_path / "pair", tmp_path / "out")
    assert report["draft_embed_tokens"]
    weights = load_file(str(tmp_path / "out" / "draft" / "model.safetensors"))
    assert torch.equal(weights["embed_tokens.weight"], draft.embed.weight.to(torch.bfloat16))
    config = json.loads((tmp_path / "out" / "draft" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["rope_theta"] == 500.0
    target, _ = load_pair(tmp_path / "pair", max_batch=1, max_seq_len=16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "target", dtype=torch.float32)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, _ = target.forward_uncached(tokens)
        torch.testing.assert_close(hf(input_ids=tokens).logits, expected, rtol=0, atol=LOGIT_ATOL)


# --- refusals --------------------------------------------------------------------------

def test_refuses_an_output_directory_that_holds_files(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=str(tmp_path)):
        export_pair("tiny-code", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_refuses_what_is_not_a_pair(tmp_path, exported):
    with pytest.raises(ValueError, match="dcp-compile train"):
        export_pair(exported[0] / "target", tmp_path / "out")  # a Hugging Face directory
    with pytest.raises(ValueError, match="not a pair"):
        export_pair(tmp_path / "nowhere", tmp_path / "out")
    assert not (tmp_path / "out").exists()
