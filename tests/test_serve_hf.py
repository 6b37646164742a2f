"""`dcp-compile serve` on a Hugging Face model directory and its EAGLE3 draft at DCP=2,
through the official ``openai`` client, against transformers' own greedy ``generate()``
on the same directory and the same (templated) prompt.

The pair is the shipped one written by ``dcp-compile export``: a transformers
``LlamaForCausalLM`` with a byte-level tokenizer and a chat template, and the draft in the
published EAGLE3 layout.  Greedy speculative decoding must return exactly what the
target alone decodes, whatever the draft proposes."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from dcp_compile.cli import main  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import load_test  # noqa: E402

MAX_BATCH, MAX_SEQ_LEN, K = 4, 320, 4
PROMPT = "def parse_args(argv):\n    \"\"\"Parse the command line.\"\"\"\n"
MESSAGES = [{"role": "system", "content": "Python 3, standard library only."},
            {"role": "user", "content": "import json\n\n\ndef load(path):\n"}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("served") / "tiny-code"
    assert main(["export", "--model", "tiny-code", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def client(exported, tmp_path_factory):
    from dcp_compile.runtime.launch import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("serve-hf") / "server.log"
    process = load_test.start_server(
        ["--model", str(exported / "target"), "--draft", str(exported / "draft"), "--dcp", "2", "--max-batch",
         str(MAX_BATCH), "--max-seq-len", str(MAX_SEQ_LEN), "--k", str(K), "--served-model-name", "tiny-code-hf"],
        port, log, 300)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
    load_test.stop_server(process)


@pytest.fixture(scope="module")
def transformers_greedy(exported):
    """``(prompt ids, new ids, text)`` of transformers' greedy generate() on the directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = str(exported / "target")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def run(ids: list[int], max_new_tokens: int):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False)
        new = out[0, len(ids):].tolist()
        return ids, new, tokenizer.decode(new, skip_special_tokens=True)

    def completion(prompt: str, max_new_tokens: int):
        return run(tokenizer(prompt).input_ids, max_new_tokens)

    def chat(messages, max_new_tokens: int):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return run(list(ids["input_ids"]), max_new_tokens)

    return completion, chat


def _finish(new: list[int], max_new_tokens: int) -> str:
    return "stop" if new and new[-1] == 0 and len(new) <= max_new_tokens else "length"


@pytest.mark.parametrize("max_tokens", [24, 160])
def test_completions_are_transformers_greedy_tokens(client, transformers_greedy, max_tokens):
    ids, new, text = transformers_greedy[0](PROMPT, max_tokens)
    assert len(new) > 16 and text.strip(), "a completion long enough to hold several verify steps"
    response = client.completions.create(model="tiny-code-hf", prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    choice = response.choices[0]
    assert choice.text == text and choice.finish_reason == _finish(new, max_tokens)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), len(new))
    assert response.usage.total_tokens == len(ids) + len(new)
    streamed = client.completions.create(model="tiny-code-hf", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                         stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason]


def test_chat_is_transformers_greedy_on_the_templated_prompt(client, transformers_greedy):
    ids, new, text = transformers_greedy[1](MESSAGES, 96)
    assert len(new) > 16 and text.strip()
    response = client.chat.completions.create(model="tiny-code-hf", messages=MESSAGES, max_tokens=96, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == _finish(new, 96)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), len(new))
    stream = client.chat.completions.create(model="tiny-code-hf", messages=MESSAGES, max_tokens=96, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(new) and not chunks[-1].choices


def test_models_lists_the_served_name_and_the_draft_is_used(client):
    import httpx

    assert [m.id for m in client.models.list().data] == ["tiny-code-hf"]
    metrics = dict(line.split() for line in httpx.get(f"{client.base_url}".replace("/v1/", "/metrics")).text.splitlines())
    assert float(metrics["dcp_mean_accept_length"]) > 2.0, "the published draft's tokens are accepted"
