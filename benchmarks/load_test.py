"""A streaming load test against `dcp-compile serve`.

    python3 benchmarks/load_test.py --url http://127.0.0.1:8000 --requests 64 --concurrency 16

Each client takes the next request, streams it (``stream: true``) and records the time
to its first token and between its chunks.  Prompts are slices of mixed length of the
shipped model's held-out code; ``max_tokens`` are mixed too.  Prints one JSON line:
completed requests, tokens, throughput, p50/p99 time to first token and inter-token
latency (ms), and the texts when ``--texts`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx


def start_server(options: list[str], port: int, log_path, start_seconds: float, tree=None):
    """``dcp-compile serve --port PORT OPTIONS`` in a subprocess, once ``/health`` answers
    (``dcp_compile.serve.start_in_background``).  ``tree``: a directory holding another
    ``dcp_compile`` package to serve with (run from there)."""
    from dcp_compile.serve import start_in_background

    return start_in_background(options, port, log_path, start_seconds, cwd=tree)


def stop_server(process, seconds: float = 60) -> None:
    """SIGTERM (the server drains), then a kill if it is still there after ``seconds``."""
    from dcp_compile.serve import stop_in_background

    stop_in_background(process, seconds)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def make_requests(n: int, seed: int = 0, prompt_lengths=(8, 200), max_tokens=(8, 96)) -> list[dict]:
    from dcp_compile.commands import training

    rng = random.Random(seed)
    prompts = training.held_out_prompts(n, prompt_lengths[1], seed=seed)
    return [dict(prompt=p[: rng.randint(*prompt_lengths)], max_tokens=rng.randint(*max_tokens)) for p in prompts]


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    arrivals, text, reasons, ids = [], "", [], set()
    async with client.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True)) as response:
        if response.status_code != 200:
            return dict(status=response.status_code, error=(await response.aread()).decode())
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return dict(status=200, error=chunk["error"]["message"])
            ids.add(chunk["id"])
            choice = chunk["choices"][0]
            arrivals.append(time.perf_counter())
            text += choice["text"]
            if choice["finish_reason"]:
                reasons.append(choice["finish_reason"])
    return dict(status=200, text=text, reasons=reasons, ids=sorted(ids), start=start, arrivals=arrivals)


async def _tokens_total(url: str) -> int:
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{url}/metrics")).text
    return next(int(line.split()[1]) for line in metrics.splitlines() if line.startswith("dcp_tokens_total "))


async def run_load(url: str, requests: list[dict], concurrency: int, timeout: float = 600) -> dict:
    """Stream every request through ``concurrency`` clients; the results in request order
    and the latency summary."""
    results: list[dict | None] = [None] * len(requests)
    next_index = iter(range(len(requests)))

    async def client_loop(client):
        for i in next_index:
            results[i] = await _stream(client, url, requests[i])

    tokens_before = await _tokens_total(url)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    tokens = await _tokens_total(url) - tokens_before
    ok = [r for r in results if r and "text" in r]
    ttft = [(r["arrivals"][0] - r["start"]) * 1e3 for r in ok if r["arrivals"]]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    summary = dict(
        requests=len(requests), completed=len(ok), seconds=round(seconds, 3), tokens=tokens,
        tokens_per_s=round(tokens / seconds, 1), requests_per_s=round(len(ok) / seconds, 3),
        ttft_ms=dict(p50=round(percentile(ttft, 50), 1), p99=round(percentile(ttft, 99), 1)),
        itl_ms=dict(p50=round(percentile(itl, 50), 1), p99=round(percentile(itl, 99), 1),
                    mean=round(statistics.fmean(itl), 1) if itl else float("nan")),
    )
    return dict(summary=summary, results=results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(8, 96), metavar=("MIN", "MAX"))
    parser.add_argument("--texts", action="store_true")
    args = parser.parse_args()
    requests = make_requests(args.requests, args.seed, max_tokens=tuple(args.max_tokens))
    out = asyncio.run(run_load(args.url, requests, args.concurrency))
    if args.texts:
        out["summary"]["texts"] = [r.get("text") for r in out["results"]]
    print(json.dumps(out["summary"]))


if __name__ == "__main__":
    main()
