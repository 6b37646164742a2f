"""Plot the decode regime from bench_e2e output: per-user time per token and aggregate
throughput against context, DCP=N against one GPU, one line per (DCP size, batch).

    python benchmarks/plot_regime.py E2E_LOG... [E2E_JSON...] OUT.png [--batches 1,8,16]

E2E_LOG: bench_e2e's stderr (lines ``size N batch B T 1 context C: X ms``), which keeps
the points measured before a run ends early; E2E_JSON: its ``--out`` file, whose rows
past one GPU's capacity (``dcp1_ms`` null) add the DCP=N step and a "refused" mark.
Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import re

LINE = re.compile(r"size (\d+) batch (\d+) T (\d+) context (\d+): ([\d.]+) ms")


def read_log(path: str, batch: int) -> dict[int, dict[int, float]]:
    """{dcp size: {context: ms}} for decode steps (T=1) of ``batch`` sequences."""
    return {size: {c: ms for (b, c), ms in found.items() if b == batch} for size, found in _sizes(path).items()
            if any(b == batch for b, _ in found)}


def read_inputs(paths: list[str]) -> tuple[dict[tuple[int, int], dict[int, float]], list[tuple[int, int]]]:
    """{(dcp size, batch): {context: ms}} of decode steps from every log and JSON, and the
    (batch, context) points where one GPU was refused."""
    times: dict[tuple[int, int], dict[int, float]] = {}
    refused = []
    for path in paths:
        if not path.endswith(".json"):
            for size, by_context in _sizes(path).items():
                for (batch, context), ms in by_context.items():
                    times.setdefault((size, batch), {})[context] = ms
            continue
        summary = json.loads(open(path).read())
        for row in summary.get("rows", []):
            if row["tokens"] == 1 and row["dcp1_ms"] is None:
                times.setdefault((summary["dcp_size"], row["batch"]), {})[row["context"]] = row["dcpn_ms"]
                refused.append((row["batch"], row["context"]))
    return times, refused


def _sizes(path: str) -> dict[int, dict[tuple[int, int], float]]:
    found: dict[int, dict[tuple[int, int], float]] = {}
    for match in LINE.finditer(open(path).read()):
        size, batch, tokens, context = (int(g) for g in match.groups()[:4])
        if tokens == 1 and context > 0:
            found.setdefault(size, {})[batch, context] = float(match.group(5))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="+", help="E2E_LOG... [E2E_JSON...] OUT.png")
    parser.add_argument("--batches", help="comma-separated batches to draw (default: every batch found)")
    args = parser.parse_args()
    *inputs, out_path = args.paths
    times, refused = read_inputs(inputs)
    if args.batches:
        keep = {int(b) for b in args.batches.split(",")}
        times = {key: t for key, t in times.items() if key[1] in keep}
        refused = [(b, c) for b, c in refused if b in keep]
    if not times:
        raise SystemExit(f"no decode steps (T=1) found in {inputs}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    colors = {1: "tab:gray", 2: "tab:blue", 4: "tab:green", 8: "tab:purple"}
    batches = sorted({batch for _, batch in times})
    markers = dict(zip(batches, "o^sDv"))
    styles = dict(zip(batches, ("-", "--", "-.", ":", "-")))
    for size, batch in sorted(times):
        series = times[size, batch]
        contexts = sorted(series)
        ms = [series[c] for c in contexts]
        k = [c / 1024 for c in contexts]
        arm = "one GPU" if size == 1 else f"DCP={size}"
        style = dict(color=colors.get(size), marker=markers[batch], ls=styles[batch], label=f"{arm}, batch {batch}")
        left.plot(k, ms, **style)
        right.plot(k, [batch * 1e3 / t for t in ms], **style)
    for batch, context in refused:
        for axis in (left, right):
            axis.axvline(context / 1024, color="tab:red", ls=":", lw=1)
        left.annotate(f"one GPU refused at batch {batch}:\ncache does not fit",
                      (context / 1024, left.get_ylim()[1] * 0.5), ha="right", fontsize=8, color="tab:red")
    left.set(title="per-user time per token", xlabel="context (K tokens)", ylabel="ms / token", ylim=(0, None))
    right.set(title="aggregate decode throughput", xlabel="context (K tokens)",
              ylabel="tokens / s, all GPUs of the arm", ylim=(0, None))
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.suptitle("Llama-3-8B-shaped target, bf16, H200, decode step in a CUDA graph", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
