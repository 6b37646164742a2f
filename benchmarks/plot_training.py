"""Plot a training run's loss curves: ``python benchmarks/plot_training.py HISTORY.json OUT.png``.

Reads the ``history.json`` that ``dcp-compile train`` writes beside the weights.
Needs matplotlib (not a dependency of the package).
"""

from __future__ import annotations

import json
import sys


def main(history_path: str, out_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = json.loads(open(history_path).read())
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110)
    steps, loss = zip(*history["target"])
    left.plot(steps, loss, label="train (minibatch)", lw=1)
    steps, loss = zip(*history["target_held_out"])
    left.plot(steps, loss, label="held-out files", lw=2)
    left.set(title="target: next-byte loss", xlabel="step", ylabel="nats / byte", ylim=(0, 3))
    left.legend()
    steps, per_step = zip(*history["draft"])
    for j in range(len(per_step[0])):
        right.plot(steps, [p[j] for p in per_step], label=f"TTT step {j}", lw=1)
    right.set(title="EAGLE3 draft: soft cross-entropy vs target", xlabel="step", ylabel="nats", ylim=(0, 3))
    right.legend()
    fig.tight_layout()
    fig.savefig(out_path)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.splitlines()[0])
    main(sys.argv[1], sys.argv[2])
