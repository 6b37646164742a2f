"""Plot the decode regime from bench_e2e output: per-user time per token and aggregate
throughput against context, DCP=2 against one GPU.

    python benchmarks/plot_regime.py E2E_LOG [EDGE_JSON] OUT.png --batch 8

E2E_LOG: bench_e2e's stderr (lines ``size N batch B T 1 context C: X ms``), which keeps
the points measured before a run ends early; EDGE_JSON: its ``--out`` file for a run
past one GPU's capacity (rows with ``dcp1_ms`` null).  Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import re

LINE = re.compile(r"size (\d+) batch (\d+) T (\d+) context (\d+): ([\d.]+) ms")


def read_log(path: str, batch: int) -> dict[int, dict[int, float]]:
    """{dcp size: {context: ms}} for decode steps (T=1) of ``batch`` sequences."""
    times: dict[int, dict[int, float]] = {}
    for match in LINE.finditer(open(path).read()):
        size, b, tokens, context = (int(g) for g in match.groups()[:4])
        ms = float(match.group(5))
        if b == batch and tokens == 1 and context > 0:
            times.setdefault(size, {})[context] = ms
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="+", help="E2E_LOG [EDGE_JSON] OUT.png")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    *inputs, out_path = args.paths
    times = read_log(inputs[0], args.batch)
    refused = []
    for path in inputs[1:]:
        summary = json.loads(open(path).read())
        for row in summary["rows"]:
            if row["batch"] == args.batch and row["tokens"] == 1:
                times.setdefault(summary["dcp_size"], {})[row["context"]] = row["dcpn_ms"]
                if row["dcp1_ms"] is None:
                    refused.append(row["context"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    colors = {1: "tab:gray", 2: "tab:blue", 4: "tab:green", 8: "tab:purple"}
    for size in sorted(times):
        contexts = sorted(times[size])
        ms = [times[size][c] for c in contexts]
        k = [c / 1024 for c in contexts]
        label = "one GPU (DCP=1, same kernels)" if size == 1 else f"DCP={size} ({size} GPUs)"
        style = dict(color=colors.get(size), marker="o" if size == 1 else "s")
        left.plot(k, ms, label=label, **style)
        right.plot(k, [args.batch * 1e3 / t for t in ms], label=label, **style)
        if size > 1:
            right.plot(k, [args.batch * 1e3 / t / size for t in ms], ls="--", mfc="none", label=f"DCP={size}, per GPU",
                       **style)
    for context in refused:
        for axis in (left, right):
            axis.axvline(context / 1024, color="tab:red", ls=":", lw=1)
        left.annotate("one GPU refused:\ncache does not fit", (context / 1024, left.get_ylim()[1] * 0.5),
                      ha="right", fontsize=8, color="tab:red")
    left.set(title=f"per-user time per token (batch {args.batch})", xlabel="context (K tokens)", ylabel="ms / token",
             ylim=(0, None))
    right.set(title=f"aggregate decode throughput (batch {args.batch})", xlabel="context (K tokens)",
              ylabel="tokens / s", ylim=(0, None))
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle("Llama-3-8B-shaped target, bf16, H200, decode step in a CUDA graph", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
