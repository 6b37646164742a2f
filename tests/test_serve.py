"""`dcp-compile serve` through a real HTTP client: 2 CPU ranks and the shipped pair."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from dcp_compile.serve.requests import BadRequest, parse_completion
from dcp_compile.text import ByteCodec

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import load_test  # noqa: E402

MAX_BATCH, MAX_SEQ_LEN, K = 4, 384, 4
START_SECONDS = 300


def start_server(port: int, log: Path, *options: str) -> subprocess.Popen:
    return load_test.start_server(["--dcp", "2", "--max-batch", str(MAX_BATCH), "--max-seq-len", str(MAX_SEQ_LEN),
                                   "--k", str(K), "--drain-seconds", "60", *options], port, log, START_SECONDS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dcp_compile.runtime.launch import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # The target's KV in a pool of 768 tokens, half what the 4 rows of 384 would reserve;
    # prefill chunks of 64, so that a prefix hit (a multiple of whole chunks) fits a prompt;
    # rows that grow a page at a time.
    process = start_server(port, log, "--page-size", "4", "--kv-tokens", str(2 * MAX_SEQ_LEN), "--chunk-size", "64",
                           "--preemption")
    yield dict(url=f"http://127.0.0.1:{port}", process=process, log=log)
    load_test.stop_server(process)


@pytest.fixture(scope="module")
def offline():
    """Offline ``generate()`` with the server's shapes, on one rank (the off arm)."""
    import dcp_compile as dcp
    from dcp_compile.models.pretrained import load_pair

    target, draft = load_pair("tiny-code", max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)
    decoder = dcp.SpecDecoder(target, draft, dcp.DCPGroup(1, 0, torch.device("cpu"), None), k=K, max_batch=MAX_BATCH,
                              max_seq_len=MAX_SEQ_LEN, lowering="aot_eager")

    def texts(prompts, max_tokens):
        outputs = [dcp.generate_all(decoder, [p], n, eos_id=0)[0] for p, n in zip(prompts, max_tokens)]
        return [(bytes(t for t in o.tokens if t != 0).decode("utf-8", "replace"), o.finished_by) for o in outputs]

    return texts


def complete(url, **body):
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def stream_text(url, **body):
    text, reasons = "", []
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True), timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reasons += [choice["finish_reason"]] if choice["finish_reason"] else []
    return text, reasons


@pytest.mark.parametrize("body, message", [
    ([1, 2], "the body must be a JSON object, got list"),
    ({"prompt": "x", "top_p": 0.9}, r"unsupported fields \['top_p'\]"),
    ({"prompt": 5}, "'prompt' must be a string or a list of token ids, got int 5"),
    ({"prompt": "x", "max_tokens": "ten"}, "'max_tokens' must be an integer, got str 'ten'"),
    ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be >= 1, got 0"),
    ({"prompt": "x", "temperature": "hot"}, "'temperature' must be a number, got str 'hot'"),
    ({"prompt": "x", "stop": 3}, "'stop' must be a non-empty string or a list of up to 4 of them"),
    ({"prompt": "x", "stream": "yes"}, "'stream' must be a boolean"),
    ({"prompt": "x", "n": 2}, "'n' must be 1"),
])
def test_request_bodies_are_checked(body, message):
    import re

    with pytest.raises(BadRequest) as error:
        parse_completion(body, "tiny-code", ByteCodec())
    assert re.search(message, str(error.value))


def test_completions_match_offline_generate(server, offline):
    url = server["url"]
    prompt = "def fibonacci(n):\n"
    response = complete(url, prompt=prompt, max_tokens=48)
    assert response.status_code == 200
    body = response.json()
    choice = body["choices"][0]
    expected_text, expected_end = offline([list(prompt.encode())], [48])[0]
    assert choice["text"] == expected_text and choice["finish_reason"] == ("length" if expected_end == "length" else "stop")
    assert body["usage"]["prompt_tokens"] == len(prompt.encode())
    streamed, reasons = stream_text(url, prompt=prompt, max_tokens=48)
    assert streamed == expected_text and reasons == [choice["finish_reason"]]
    # token ids as the prompt, and a stop string that cuts the text before it
    cut = expected_text[10:14]
    stopped = complete(url, prompt=list(prompt.encode()), max_tokens=48, stop=[cut]).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == expected_text[: expected_text.index(cut)]
    assert stream_text(url, prompt=prompt, max_tokens=48, stop=cut) == (stopped["text"], ["stop"])


def test_bad_requests_get_400_while_a_stream_runs(server, offline):
    url = server["url"]
    prompt = "import os\n"
    expected, _ = offline([list(prompt.encode())], [120])[0]

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            running = asyncio.create_task(load_test._stream(client, url, dict(prompt=prompt, max_tokens=120)))
            await asyncio.sleep(0.2)
            bad = [
                await client.post(f"{url}/v1/completions", content=b"{not json"),
                await client.post(f"{url}/v1/completions", json={"prompt": "x" * MAX_SEQ_LEN, "max_tokens": 8}),
                await client.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 0}),
                await client.post(f"{url}/v1/completions", json={"prompt": "x", "temperature": [1]}),
                await client.post(f"{url}/v1/completions", json={"prompt": [300], "max_tokens": 4}),
            ]
            return await running, bad

    result, bad = asyncio.run(scenario())
    assert [r.status_code for r in bad] == [400] * 5
    messages = [r.json()["error"]["message"] for r in bad]
    assert messages[0].startswith("the body is not valid JSON")
    assert f"the cache holds max_seq_len={MAX_SEQ_LEN}" in messages[1]
    assert "'max_tokens' must be >= 1" in messages[2] and "'temperature' must be a number" in messages[3]
    assert "prompt token ids must be ints in [0, 256)" in messages[4]
    assert result["text"] == expected and result["reasons"] == ["length"]


def metric(url, name):
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_a_client_that_disconnects_frees_its_row(server):
    url = server["url"]
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(prompt="class A:\n", max_tokens=300, stream=True),
                      timeout=60) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    deadline = time.monotonic() + 20
    while metric(url, "dcp_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(url, "dcp_requests_running") == 0
    assert metric(url, "dcp_kv_pool_used_tokens") == 0, "its pages went back to the pool"
    assert metric(url, "dcp_kv_pool_capacity_tokens") == 2 * MAX_SEQ_LEN
    assert metric(url, "dcp_preemptions_total") == 0, "no request ran short of pages"
    finished = metric(url, "dcp_tokens_total")
    time.sleep(0.5)
    assert metric(url, "dcp_tokens_total") == finished  # nothing decodes for it any more


def test_a_repeated_prompt_reuses_its_cached_pages(server, offline):
    """Through the official client: the second request's first 64 tokens (one prefill chunk of
    eight logical pages of 4 x 2 tokens) come from the pool's prefix cache, and its text is
    the first's and offline generate's."""
    import openai

    url = server["url"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    prompt = "# read the configuration file and return its sections as a dict of dicts\nimport configpa"
    hits = metric(url, "dcp_prefix_cache_hit_tokens_total")
    first = client.completions.create(model=model, prompt=prompt, max_tokens=24)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=24)
    assert len(prompt) == 88 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 64
    assert metric(url, "dcp_prefix_cache_hit_tokens_total") == hits + 64
    expected, _ = offline([list(prompt.encode())], [24])[0]
    assert first.choices[0].text == second.choices[0].text == expected


def test_requests_that_outgrow_the_pool_are_preempted_and_computed_again(server, offline):
    """Four requests of 250 new tokens need more than the pool's 768 tokens together: rows grow
    a page at a time, the newest is preempted and recomputed, on both ranks alike, and every
    text is still offline generate's."""
    from concurrent.futures import ThreadPoolExecutor

    url = server["url"]
    prompts = ["def parse(path):\n", "class Stack:\n", "import json\n", "for item in items:\n"]
    before = metric(url, "dcp_preemptions_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: complete(url, prompt=p, max_tokens=250).json(), prompts))
    expected = offline([list(p.encode()) for p in prompts], [250] * len(prompts))
    assert [r["choices"][0]["text"] for r in responses] == [text for text, _ in expected]
    assert metric(url, "dcp_preemptions_total") > before, "the pool ran short of pages"
    assert metric(url, "dcp_kv_pool_used_tokens") == 0


def test_load_64_streaming_requests_from_16_clients(server, offline):
    url = server["url"]
    requests = load_test.make_requests(64, seed=3, max_tokens=(4, 40))
    compiles = metric(url, "dcp_compiles_total")
    out = asyncio.run(load_test.run_load(url, requests, concurrency=16))
    summary, results = out["summary"], out["results"]
    print("load test:", json.dumps(summary))
    assert summary["completed"] == 64, [r for r in results if "text" not in r][:3]
    ids = [r["ids"] for r in results]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == 64  # one id per stream, none shared
    assert all(len(r["reasons"]) == 1 for r in results)  # exactly one end per request
    expected = offline([r["prompt"] for r in requests], [r["max_tokens"] for r in requests])
    assert [r["text"] for r in results] == [text for text, _ in expected]
    assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["p99"] >= summary["itl_ms"]["p50"]
    assert compiles > 0 and metric(url, "dcp_compiles_total") == compiles  # arrivals and departures never recompile


def test_sigterm_drains_running_requests_and_exits_0(server):
    url, process = server["url"], server["process"]

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            running = asyncio.create_task(load_test._stream(client, url, dict(prompt="def main():\n", max_tokens=200)))
            await asyncio.sleep(0.5)
            process.send_signal(signal.SIGTERM)
            return await running

    result = asyncio.run(scenario())
    assert result["reasons"] == ["length"]
    assert process.wait(timeout=60) == 0


def _followers(pid: int, log: Path) -> list[int]:
    """The server's follower ranks: its spawned children but the HTTP process, which the
    log names."""
    http = int(re.search(r"HTTP in pid (\d+)", log.read_text()).group(1))
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                children.append(int(entry.name))
    assert http in children, (http, children)
    return [child for child in children if child != http]


@pytest.mark.skipif(not Path("/proc").exists(), reason="finds the follower rank through /proc")
def test_a_killed_follower_ends_the_server_with_an_error(tmp_path):
    from dcp_compile.runtime.launch import free_port

    port = free_port()
    process = start_server(port, tmp_path / "server.log")
    try:
        url = f"http://127.0.0.1:{port}"
        followers = _followers(process.pid, tmp_path / "server.log")
        assert len(followers) == 1, followers
        with httpx.stream("POST", f"{url}/v1/completions", json=dict(prompt="import sys\n", max_tokens=300, stream=True),
                          timeout=60) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            os.kill(followers[0], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert "the engine failed" in json.loads(rest[-1][6:])["error"]["message"], rest[-3:]
        assert process.wait(timeout=60) == 1
        assert "the engine stopped" in (tmp_path / "server.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.skipif(not Path("/proc").exists(), reason="finds the follower rank through /proc")
def test_a_hung_follower_ends_the_server_within_the_collective_timeout(tmp_path):
    from dcp_compile.runtime.launch import free_port

    port = free_port()
    process = start_server(port, tmp_path / "server.log", "--collective-timeout", "5")
    followers = _followers(process.pid, tmp_path / "server.log")
    try:
        assert len(followers) == 1, followers
        os.kill(followers[0], signal.SIGSTOP)  # idle: only the heartbeat notices
        start = time.monotonic()
        assert process.wait(timeout=60) == 1
        assert time.monotonic() - start < 30
        assert "the engine stopped" in (tmp_path / "server.log").read_text()
    finally:
        for pid in followers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if process.poll() is None:
            process.kill()
