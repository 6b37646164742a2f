"""dcp_compile.text: codecs, incremental decoding, EOS sets, chat templates."""

import json
import random

import pytest

from dcp_compile.text import SHIPPED_EOS, ByteCodec, HFCodec, check_messages
from tests.support.text import CHAT_TEMPLATE, FAMILIES, tokenizer_dir


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {family: tokenizer_dir(root / family, family) for family in FAMILIES}


def make_codec(family, hf_dirs):
    return ByteCodec() if family == "bytes" else HFCodec(hf_dirs[family])


def one_shot(codec, ids):
    if isinstance(codec, ByteCodec):
        return bytes(t for t in ids if t not in codec.eos_ids).decode("utf-8", "replace")
    return codec.decode(ids)


def streamed(decoder, pieces):
    return [decoder.push(piece) for piece in pieces] + [decoder.finish()]


def random_splits(rng, ids):
    pieces, i = [], 0
    while i < len(ids):
        n = rng.choice([0, 1, 1, 1, 2, 3, 7])
        pieces.append(ids[i:i + n])
        i += n
    return pieces


@pytest.mark.parametrize("family", ["bytes", *FAMILIES])
def test_incremental_decoding_equals_one_shot_for_any_split(family, hf_dirs):
    codec = make_codec(family, hf_dirs)
    rng = random.Random(7)
    # Whole words: their ids make valid UTF-8 however they are put together.
    words = [codec.encode(word) for word in "Hello world! café 🙂 日本語 def f(x):\n return  x".split(" ")]
    if family == "sentencepiece":
        # tokenizers' ByteFallback decodes a run of <0xNN> tokens that is not valid UTF-8
        # as U+FFFD for every byte of the run, valid ones before it included, which no
        # stream can take back: byte tokens come in whole characters here.
        vocab = codec.tokenizer.get_vocab()
        units = [[i] for token, i in sorted(vocab.items()) if not (token.startswith("<0x") and len(token) == 6)]
        units += [_byte_ids(codec, c.encode()) for c in "é🙂日€"] * 20
    else:
        units = [[i] for i in range(256 if family == "bytes" else len(codec.tokenizer))]
    for trial in range(60):
        # Random ids (many invalid UTF-8 sequences, special tokens among them), and ids
        # of real text, where characters of several bytes do complete.
        pool = words if trial % 2 else units
        ids = [t for _ in range(rng.randint(0, 30)) for t in rng.choice(pool)]
        pieces = random_splits(rng, ids)
        assert "".join(streamed(codec.decoder(), pieces)) == one_shot(codec, ids), (trial, pieces)


def _byte_ids(codec, data: bytes) -> list[int]:
    """Token ids of ``data`` one byte per token."""
    if isinstance(codec, ByteCodec):
        return list(data)
    tokenizer = codec.tokenizer
    if "<0x41>" in tokenizer.get_vocab():  # byte fallback
        return tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in data])
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return tokenizer.convert_tokens_to_ids([bytes_to_unicode()[b] for b in data])


@pytest.mark.parametrize("family", ["bytes", *FAMILIES])
def test_a_character_split_over_tokens_comes_out_whole_when_its_last_byte_arrives(family, hf_dirs):
    codec = make_codec(family, hf_dirs)
    ids = _byte_ids(codec, "é🙂".encode())
    assert streamed(codec.decoder(), [[t] for t in ids]) == ["", "é", "", "", "", "🙂", ""]
    # an incomplete character at the end becomes U+FFFD once the completion ends (one
    # for each byte with byte fallback tokens)
    rest = streamed(codec.decoder(), [ids[2:4]])
    assert rest[0] == "" and rest[1] == one_shot(codec, ids[2:4]) and set(rest[1]) == {"\ufffd"}


@pytest.mark.parametrize("family", ["bytes", *FAMILIES])
def test_eos_and_special_tokens_are_not_text(family, hf_dirs):
    codec = make_codec(family, hf_dirs)
    ids = codec.encode("Hi there")
    (eos,) = codec.eos_ids
    assert "".join(streamed(codec.decoder(), [[t] for t in ids + [eos]])) == one_shot(codec, ids)
    assert "\x00" not in "".join(streamed(codec.decoder(), [ids + [eos]]))
    if family != "bytes":
        start = codec.tokenizer.convert_tokens_to_ids("<|start|>")
        assert "".join(streamed(codec.decoder(), [[start], ids, [start]])) == "Hi there"


@pytest.mark.parametrize("family", [*FAMILIES])
def test_a_completion_decodes_as_it_reads_after_its_prompt(family, hf_dirs):
    """A SentencePiece token's leading space is dropped at the start of a text, not after
    the prompt: the decoder starts from the prompt's last tokens."""
    codec = make_codec(family, hf_dirs)
    full = codec.encode("x 日本 world")
    tokens = codec.tokenizer.convert_ids_to_tokens(full)
    cut = next(i for i in range(2, len(full)) if tokens[i][0] in "▁Ġ")
    prompt, completion = full[:cut], full[cut:]
    text = "".join(streamed(codec.decoder(prompt), [[t] for t in completion]))
    assert text == codec.decode(full)[len(codec.decode(prompt)):] and text.startswith(" ")
    if family == "sentencepiece":
        assert not codec.decode(completion).startswith(" ")  # what a decoder without the prompt would emit


def test_byte_codec():
    codec = ByteCodec(eos_id=SHIPPED_EOS)
    assert codec.eos_ids == {0} and codec.encode("é!") == [0xC3, 0xA9, 0x21] and not codec.has_chat_template
    with pytest.raises(ValueError, match="the shipped byte-level model has no chat template"):
        codec.chat_ids([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"a byte value in \[0, 256\), got 300"):
        ByteCodec(eos_id=300)


def test_a_completion_prompt_gets_the_tokenizers_special_tokens(hf_dirs):
    codec = HFCodec(hf_dirs["sentencepiece"])
    ids = codec.encode("Hello")
    assert ids[0] == codec.tokenizer.bos_token_id and ids == codec.tokenizer("Hello").input_ids


@pytest.mark.parametrize("generation, config, expected", [
    (None, None, {1}),  # the tokenizer's eos_token </s>
    (None, 7, {7}),
    (None, [7, 8], {7, 8}),
    (5, [7, 8], {5}),  # generation_config.json first, as generate() reads it
    ([5, 6], None, {5, 6}),
])
def test_eos_ids_come_from_generation_config_then_config_then_the_tokenizer(generation, config, expected, tmp_path):
    directory = tokenizer_dir(tmp_path / "model", generation_eos=generation, config_eos=config)
    assert HFCodec(directory).eos_ids == expected


def test_a_bad_eos_token_id_names_the_file(tmp_path):
    directory = tokenizer_dir(tmp_path / "model", generation_eos=["</s>"])
    with pytest.raises(ValueError, match=r"generation_config.json: 'eos_token_id' must be a token id or a list"):
        HFCodec(directory)


def test_chat_messages_render_through_the_template_up_to_the_assistants_turn(hf_dirs):
    codec = HFCodec(hf_dirs["byte_level"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi café"}]
    ids = codec.chat_ids(messages)
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    assert codec.tokenizer.decode(ids) == "<s><|start|>system\nBe brief.<|end|>\n<|start|>user\nHi café<|end|>\n" \
                                         "<|start|>assistant\n"


def test_a_tokenizer_without_a_chat_template_refuses_chat_naming_its_directory(tmp_path):
    directory = tokenizer_dir(tmp_path / "base", chat_template=None)
    codec = HFCodec(directory)
    assert not codec.has_chat_template
    with pytest.raises(ValueError, match=f"the tokenizer in {directory} has no chat template"):
        codec.chat_ids([{"role": "user", "content": "hi"}])


def test_a_template_that_raises_is_a_value_error(tmp_path):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first turn is the user') }}{% endif %}" \
               + CHAT_TEMPLATE
    codec = HFCodec(tokenizer_dir(tmp_path / "strict", chat_template=template))
    with pytest.raises(ValueError, match="refused the messages: the first turn is the user"):
        codec.chat_ids([{"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize("messages, message", [
    ([], r"'messages' must be a non-empty list of messages, got list \[\]"),
    ("hi", "'messages' must be a non-empty list of messages, got str 'hi'"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object with 'role' and 'content', got str"),
    ([{"role": "bot", "content": "a"}], r"messages\[0\]\['role'\] must be one of \['system', 'user', 'assistant', "
                                        r"'tool'\], got 'bot'"),
    ([{"content": "a"}], r"messages\[0\]\['role'\] must be one of .*, got None"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\['content'\] must be a string, got list"),
    ([{"role": "user"}], r"messages\[0\]\['content'\] must be a string, got NoneType"),
    ([{"role": "user", "content": "a", "images": []}], r"messages\[0\] has unsupported fields \['images'\]"),
])
def test_bad_messages_are_refused_with_their_index(messages, message):
    with pytest.raises(ValueError, match=message):
        check_messages(messages)


def test_generation_config_is_read_as_json(tmp_path):
    directory = tokenizer_dir(tmp_path / "model")
    (directory / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        HFCodec(directory)
    (directory / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert HFCodec(directory).eos_ids == {1}
