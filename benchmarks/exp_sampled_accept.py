"""The sampled acceptance alone, against an earlier form of it and against greedy: what a
sampled step costs on the device at a real vocabulary.

    python3 benchmarks/exp_sampled_accept.py --old REV --out $OUT/accept.json     # one GPU
    python3 benchmarks/exp_sampled_accept.py --old REV --device cpu --vocab 512 --batches 2   # the script, on CPU

``--old REV``: the acceptance of ``dcp_compile/runtime/sampling.py`` and ``tree.py`` at git
revision ``REV``, loaded from ``git show`` (or from a folder holding the two files) as
modules of their own.  For each batch, the
chain (``accept_chain``, k=3, the draft's distribution over the target vocabulary) and a
tree (``accept_sampled``, 6,4,16), at temperature 0.8 on random bf16 logits:

- **old**, **new**: the sampled acceptance; **fused**: the new one with its decisions
  compiled by Inductor apart from its draws (``sampling.chain_rule``, ``tree.accept_sampled``
  over ``tree.draw``, as ``SpecDecoder`` runs them on a GPU); **greedy**: the greedy acceptance of the same
  shape, the floor a sampled step is held to;
- each captured in a CUDA graph (the generator registered, as in the one-graph step) and
  timed by its replays, median of ``--reps``; on CPU, the host clock;
- **agree**: the fraction of rows where old and new accept the same count and bonus from
  the same draws (they differ only where rounding flips a comparison).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import torch

from dcp_compile.runtime import sampling, tree
from dcp_compile.runtime.cuda_graphs import capture
from dcp_compile.runtime.tree import TreeShape, accept_greedy, expand, select
from _report import leave, log, median_ms, parse_with_watchdog, report

REPO = Path(__file__).resolve().parents[1]


def load_old(rev: str) -> types.SimpleNamespace:
    """``sampling`` and ``tree`` of ``rev`` as modules of their own (the old tree imports
    the old sampling)."""
    modules = {}
    for name in ("sampling", "tree"):
        if Path(rev).is_dir():  # the files of a revision, written out where git is not (the GPU machine)
            source = (Path(rev) / f"{name}.py").read_text()
        else:
            source = subprocess.run(["git", "show", f"{rev}:dcp_compile/runtime/{name}.py"], cwd=REPO, check=True,
                                    capture_output=True, text=True).stdout
        source = source.replace("from dcp_compile.runtime.sampling import", "from old_accept_sampling import")
        spec = importlib.util.spec_from_loader(f"old_accept_{name}", loader=None)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        exec(compile(source, f"{rev}:{name}.py", "exec"), module.__dict__)
        modules[name] = module
    return types.SimpleNamespace(**modules)


def random_tree(shape: TreeShape, B: int, V: int, device) -> tree.Tree:
    gen = torch.Generator(device=device).manual_seed(3)
    levels, scores = [], torch.zeros(B, 1, device=device)
    for d in range(shape.k):
        frontier = 1 if d == 0 else shape.topk
        logprobs = torch.log_softmax(4 * torch.randn(B, frontier, V, generator=gen, device=device), -1)
        level = expand(scores, logprobs, shape.topk)
        levels.append(level)
        scores = level.scores.gather(1, level.frontier)
    return select(shape, levels)


def timed(fn, generator, reps: int, cuda: bool) -> float:
    if not cuda:
        return median_ms(fn, reps, warmup=1, cuda=False)
    graph, _ = capture(fn, generators=(generator,))
    return median_ms(graph.replay, reps, warmup=3)


def agree(a, b) -> float:
    same = torch.ones_like(a[0], dtype=torch.bool)
    for x, y in zip(a, b):
        same &= (x == y).view(x.shape[0], -1).all(-1)
    return same.float().mean().item()


def measure(batch: int, args, old, device) -> list[dict]:
    cuda = device.type == "cuda"
    V, k = args.vocab, 3
    gen = torch.Generator(device=device).manual_seed(0)
    temperature = torch.full((batch,), 0.8, device=device)
    rows = []
    # The chain: the target's logits after t0, d1..dk, drafts, the draft's distributions.
    logits = (3 * torch.randn(batch, k + 1, V, generator=gen, device=device)).to(torch.bfloat16)
    q = torch.softmax(3 * torch.randn(batch, k, V, generator=gen, device=device), -1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=gen).view(batch, k)
    fused = torch.compile(sampling.chain_rule, backend="inductor" if cuda else "aot_eager", fullgraph=True,
                          dynamic=False)
    arms = {
        "old": lambda g: old.sampling.accept_chain(logits, drafts, q, temperature, g),
        "new": lambda g: sampling.accept_chain(logits, drafts, q, temperature, g),
        "fused": lambda g: sampling.accept_chain(logits, drafts, q, temperature, g, fused),
        "greedy": lambda g: sampling.accept_chain(logits, drafts, None, 0.0, g),
    }
    rows.append(compare("chain k=3", batch, arms, device, args, cuda))
    shape = TreeShape(6, 4, 16)
    t = random_tree(shape, batch, V, device)
    tree_logits = (3 * torch.randn(batch, shape.verify_tokens, V, generator=gen, device=device)).to(torch.bfloat16)
    fused_tree = torch.compile(tree.accept_sampled, backend="inductor" if cuda else "aot_eager", fullgraph=True,
                               dynamic=False)
    arms = {
        "old": lambda g: old.tree.accept_sampled(t, tree_logits, temperature, g),
        "new": lambda g: tree.accept_sampled(t, tree_logits, temperature, g),
        "fused": lambda g: fused_tree(t, tree_logits, temperature, tree.draw(g, batch, shape, V, device)),
        "greedy": lambda g: accept_greedy(t, tree_logits),
    }
    rows.append(compare("tree 6,4,16", batch, arms, device, args, cuda))
    return rows


def compare(name: str, batch: int, arms: dict, device, args, cuda: bool) -> dict:
    outputs = {arm: tuple(fn(torch.Generator(device=device).manual_seed(7))) for arm, fn in arms.items()}
    row = dict(shape=name, batch=batch, vocab=args.vocab, agree=agree(outputs["old"], outputs["new"]))
    if "fused" in outputs:
        row["agree_fused"] = agree(outputs["new"], outputs["fused"])
    for arm, fn in arms.items():
        generator = torch.Generator(device=device).manual_seed(7)
        row[f"{arm}_ms"] = timed(lambda: fn(generator), generator, args.reps, cuda)
    row["new_over_greedy"] = row["new_ms"] / row["greedy_ms"]
    row["old_over_greedy"] = row["old_ms"] / row["greedy_ms"]
    if "fused_ms" in row:
        row["fused_over_greedy"] = row["fused_ms"] / row["greedy_ms"]
    log(f"  {row}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="git revision of the earlier acceptance")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out")
    args = parse_with_watchdog(parser)
    device = torch.device(args.device)
    old = load_old(args.old)
    rows = [row for batch in args.batches for row in measure(batch, args, old, device)]
    print("| shape | batch | greedy ms | old ms | new ms | fused ms | old / greedy | new / greedy | fused / greedy | "
          "agree | agree fused |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['greedy_ms']:.3f} | {r['old_ms']:.3f} | {r['new_ms']:.3f} | "
              f"{r.get('fused_ms', nan):.3f} | {r['old_over_greedy']:.2f} | {r['new_over_greedy']:.2f} | "
              f"{r.get('fused_over_greedy', nan):.2f} | {r['agree']:.4f} | {r.get('agree_fused', nan):.4f} |")
    report(dict(rows=rows, old=args.old, torch=torch.__version__,
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu"), args.out)
    leave()


if __name__ == "__main__":
    main()
