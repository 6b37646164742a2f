"""Accept length of EAGLE-2 dynamic trees on the shipped pair, from a cacheless reference.

    python benchmarks/tree_accept_table.py --out benchmarks/results/2026-12-02/tree-accept/table.json
    python benchmarks/tree_accept_table.py --quick --out /tmp/tree-quick.json   # smoke run, < 60 s

The shipped ``tiny-code`` target and its EAGLE3 draft, greedy, fp32 on CPU, on the held-out
prompts ``dcp-compile eval`` decodes (``training.held_out_prompts``: 192-byte prompts), for
``--new-tokens`` tokens per prompt counted as the engine counts them (the first token comes
from the prefill, then verify steps until at least that many are emitted).  The accept
length is the repo's: tokens emitted per verify step, ``accepted + 1``, averaged over steps.

No KV cache is read or written.  A verify step at root position ``L`` (the last emitted
token, not yet verified) does what the serving loop does, from inputs alone:

- the draft's entries over the context: entry ``p < L`` reads the target's features at
  ``p`` and token ``p + 1`` (the EAGLE convention), causal attention over the entries;
  its output at ``L - 1`` gives the root's children;
- the tree, depth by depth, with ``runtime.tree.expand``: a node at depth ``d`` is a draft
  entry at position ``L - 1 + d`` reading its parent's output hidden state and its own
  token, attending to the context's entries and to its ancestors' entries (its own path:
  every frontier node of a depth has a path of the same length, so they run as rows);
  ``runtime.tree.select`` keeps the best ``draft_tokens``;
- the target's logits at the root and every node given the context and the node's
  ancestor path, then ``runtime.tree.accept_greedy``.

Two ways of scoring the target give the same accept counts (asserted on the first prompt:
``PATHS_CHECKED`` for 32 tokens in a full run, every configuration for 8 with ``--quick``):

- ``paths``: per step, the target's uncached forward over the context (its features), and
  one uncached forward over the context and all nodes under the ancestor mask (each node
  sees the context and its ancestors, at position ``L + depth``).  Nothing is shared
  between steps.  Two target forwards per step: too costly on 2 CPU cores for the table.
- ``continuation`` (the table): greedy acceptance emits the target's own greedy
  continuation ``S``, whatever the draft, so every context is a prefix of ``S``, and
  ``accept_greedy`` reads the target's logits only along the accepted path, whose nodes are
  prefixes of ``S``.  ``S`` is proposed by the target's greedy decoding and then proved by
  one uncached forward over ``S`` (its argmax at every position must be the next token of
  ``S``; the script fails otherwise), whose logits and features serve every step: a node on
  ``S`` gets the logits at its position, a node off ``S`` gets zeros (no walk reaches it).

The first check is against the serving loop: the chain (``topk=1, draft_tokens=k``) must
give exactly the accept counts ``training.measure_acceptance`` (``dcp-compile eval``)
reports on the same prompts, ``k`` and length.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dcp_compile.commands import training
from dcp_compile.models.pretrained import load_pair
from dcp_compile.runtime import tree as tree_lib

MODEL = "tiny-code"
DEPTHS = (3, 4, 5, 6)
TOPKS = (1, 2, 4)
DRAFT_TOKENS = (8, 16, 32, 64)  # besides draft_tokens = k, where the tree holds them
QUICK_CONFIGS = ((3, 1, 3), (3, 2, 8), (3, 4, 16))
PATHS_CHECKED = ((5, 1, 5), (5, 4, 16), (6, 4, 64))  # the full run checks these against the paths scoring


def configs(depths=DEPTHS, topks=TOPKS) -> list[tree_lib.TreeShape]:
    """Every ``(k, topk, draft_tokens)`` the tree can hold: ``draft_tokens`` in ``k`` and
    ``DRAFT_TOKENS``, at most ``topk + (k - 1) * topk**2``; topk=1 is the chain alone."""
    shapes = []
    for k in depths:
        for topk in topks:
            for n in sorted({k, *DRAFT_TOKENS}):
                if k <= n <= topk + (k - 1) * topk**2:
                    shapes.append(tree_lib.TreeShape(k, topk, n))
    return shapes


# ---- the draft, uncached


def draft_entries(draft, next_tokens: torch.Tensor, features: torch.Tensor):
    """The draft's entries ``p = 0..T-1`` over a context: token ``next_tokens[p]`` (the
    token at ``p + 1``) and the target's features ``features [T, kH]`` at ``p``, causal.
    Returns ``(k, v)`` of the entries ``[1, H_kv, T, D]`` and the log-probs ``[T, V]`` and
    output hidden states ``[T, H]`` at each."""
    T = next_tokens.shape[0]
    positions = torch.arange(T)
    cos, sin = draft.rope_cos[None, positions], draft.rope_sin[None, positions]
    hidden, attn_in = draft._attention_input(next_tokens[None], features[None])
    q, k, v = (t.transpose(1, 2) for t in draft.attention.project(attn_in, cos, sin))  # [1, H, T, D]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    logits, h = draft._finish(hidden + draft.attention.wo(out.transpose(1, 2).reshape(1, T, -1)))
    return k, v, torch.log_softmax(logits[0].float(), -1), h[0]


def draft_expansions(draft, root: int, base, max_depth: int, topk: int) -> list[tree_lib.Expansion]:
    """``max_depth`` expansions of EAGLE-2's tree at root position ``root``, from the
    context's entries ``base = draft_entries(...)`` (entries ``0..root-1`` are used).

    A frontier node at depth ``d`` runs as a draft entry at position ``root - 1 + d``: its
    token, its parent's output hidden state (the root's: entry ``root - 1``'s), and
    attention over the context's entries and its own path's entries."""
    k_all, v_all, logprobs_all, hidden_all = base
    base_k, base_v = k_all[:, :, :root], v_all[:, :, :root]  # [1, H_kv, root, D]
    logprobs = logprobs_all[root - 1][None, None]  # [1, 1, V]: the root's children
    frontier_scores = torch.zeros(1, 1)
    parent_hidden = hidden_all[root - 1][None]  # [F, H] the frontier's output hidden states
    path_k = path_v = None  # [F, H_kv, d, D] each frontier node's path entries, root side first
    expansions = []
    for depth in range(1, max_depth + 1):
        e = tree_lib.expand(frontier_scores, logprobs, topk)
        expansions.append(e)
        if depth == max_depth:
            break
        frontier = e.frontier[0]  # [topk] candidates of this depth that the next expands
        parents = e.parents[0, frontier]  # their parents among the previous frontier
        tokens = draft.to_target_ids(e.tokens[0, frontier])  # [topk]
        features = parent_hidden[parents]  # [topk, H]
        position = torch.full((topk, 1), root - 1 + depth)
        cos, sin = draft.rope_cos[position], draft.rope_sin[position]
        hidden, attn_in = draft._attention_input(tokens[:, None], features[:, None])
        q, k, v = (t.transpose(1, 2) for t in draft.attention.project(attn_in, cos, sin))  # [topk, H, 1, D]
        if path_k is None:
            path_k, path_v = k, v
        else:
            path_k, path_v = torch.cat([path_k[parents], k], dim=2), torch.cat([path_v[parents], v], dim=2)
        keys = torch.cat([base_k.expand(topk, -1, -1, -1), path_k], dim=2)
        values = torch.cat([base_v.expand(topk, -1, -1, -1), path_v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        logits, h = draft._finish(hidden + draft.attention.wo(out.transpose(1, 2).reshape(topk, 1, -1)))
        logprobs = torch.log_softmax(logits[:, 0].float(), -1)[None]  # [1, topk, V]
        parent_hidden = h[:, 0]
        frontier_scores = e.scores.gather(1, e.frontier)
    return expansions


def select_tree(draft, shape: tree_lib.TreeShape, expansions) -> tree_lib.Tree:
    """The verified tree of ``shape`` from the first ``k`` expansions, its tokens in target ids."""
    t = tree_lib.select(shape, expansions[: shape.k])
    return dataclasses.replace(t, tokens=draft.to_target_ids(t.tokens))


# ---- the target, uncached


def target_tree_logits(target, context: torch.Tensor, t: tree_lib.Tree) -> torch.Tensor:
    """``[N+1, V]`` the target's logits at the root (``context[-1]``) and at every node,
    each given the context and its ancestor path: one uncached forward over the context
    and the nodes, the nodes at ``root + depth`` under the ancestor mask."""
    T0, N = context.shape[0], t.tokens.shape[1]
    tokens = torch.cat([context, t.tokens[0]])
    positions = torch.cat([torch.arange(T0), T0 - 1 + t.depth[0]])
    mask = torch.zeros(T0 + N, T0 + N, dtype=torch.bool)
    mask[:T0, :T0] = torch.ones(T0, T0, dtype=torch.bool).tril()
    mask[T0:, :T0] = True
    mask[T0:, T0:] = t.ancestors[0, 1:, 1:]
    cos, sin = target.rope_cos[None, positions], target.rope_sin[None, positions]
    x = target.tok_embeddings(tokens[None])
    for layer in target.layers:
        a = layer.attention
        q, k, v = (u.transpose(1, 2) for u in a.project(layer.attention_norm(x), cos, sin))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        h = x + a.wo(out.transpose(1, 2).reshape(1, T0 + N, -1))
        x = h + layer.feed_forward(layer.ffn_norm(h))
    return target.output(target.norm(x[0, T0 - 1 :])).float()


class Continuation:
    """The target's greedy continuation ``S`` of one prompt, proved by one uncached forward
    over it, and the draft's entries over ``S``: every context of every step is a prefix."""

    def __init__(self, target, draft, prompt: list[int], length: int):
        self.seq = greedy_continuation(target, prompt, length)
        logits, features = target.forward_uncached(self.seq[None])
        greedy = logits[0].argmax(-1)
        n = len(prompt)
        wrong = (greedy[n - 1 : -1] != self.seq[n:]).nonzero()
        if wrong.numel():
            p = n - 1 + int(wrong[0])
            raise AssertionError(f"the proposed continuation is not the uncached target's greedy one: at position {p} "
                                 f"the uncached argmax is {int(greedy[p])}, the proposal has {int(self.seq[p + 1])}")
        self.logits = logits[0]
        self.base = draft_entries(draft, self.seq[1:], features[0, :-1])

    def tree_logits(self, root: int, t: tree_lib.Tree) -> torch.Tensor:
        """``[N+1, V]``: the logits at the root and at the nodes on ``S``; zeros elsewhere
        (``accept_greedy`` moves only along nodes on ``S``, and reads no other's logits)."""
        N = t.tokens.shape[1]
        out = torch.zeros(N + 1, self.logits.shape[-1])
        out[0] = self.logits[root]
        on = torch.zeros(N + 1, dtype=torch.bool)
        on[0] = True
        for j in range(N):  # topological order: a parent comes first
            d = int(t.depth[0, j])
            on[j + 1] = bool(on[int(t.parents[0, j]) + 1]) and root + d < len(self.seq) and \
                int(t.tokens[0, j]) == int(self.seq[root + d])
            if on[j + 1]:
                out[j + 1] = self.logits[root + d]
        return out


def greedy_continuation(target, prompt: list[int], length: int) -> torch.Tensor:
    """``prompt`` and ``length`` greedy tokens.  Proposed with the target's own eager
    forward; ``Continuation`` proves it with the uncached forward before anything uses it."""
    seq = torch.tensor(prompt)
    logits, _ = target(seq[None], torch.arange(len(prompt))[None])
    out = [int(logits[0, -1].argmax())]
    for i in range(length - 1):
        position = torch.tensor([[len(prompt) + i]])
        logits, _ = target(torch.tensor([[out[-1]]]), position)
        out.append(int(logits[0, -1].argmax()))
    return torch.cat([seq, torch.tensor(out)])


# ---- the decoding loop


def decode(prompt_len: int, new_tokens: int, step) -> list[int]:
    """Accept counts per verify step, as the engine runs them: the prefill emits one token,
    then steps until ``new_tokens`` are emitted (the last step's count is kept whole).
    ``step(root) -> accepted``: the verify step at root position ``root``."""
    emitted, accepted = 1, []
    while emitted < new_tokens:
        a = step(prompt_len + emitted - 1)
        accepted.append(a)
        emitted += a + 1
    return accepted


def run_continuation(target, draft, prompts, new_tokens: int, shapes) -> dict:
    """Accept counts of every shape on every prompt, scoring along the continuation."""
    max_depth = max(s.k for s in shapes)
    results = {s: [] for s in shapes}
    for prompt in prompts:
        cont = Continuation(target, draft, prompt, new_tokens + max_depth + 1)
        memo: dict[tuple[int, int], list] = {}
        for s in shapes:
            def step(root, s=s, cont=cont, memo=memo):
                key = (root, s.topk)
                if key not in memo:
                    memo[key] = draft_expansions(draft, root, cont.base, max_depth, s.topk)
                t = select_tree(draft, s, memo[key])
                return int(tree_lib.accept_greedy(t, cont.tree_logits(root, t)[None]).count[0])
            results[s].append(decode(len(prompt), new_tokens, step))
        print(f"prompt {len(results[shapes[0]])}/{len(prompts)}: {len(memo)} trees drafted", file=sys.stderr, flush=True)
    return results


def run_paths(target, draft, prompts, new_tokens: int, shapes) -> dict:
    """Accept counts of every shape on every prompt, every step from scratch."""
    results = {s: [] for s in shapes}
    for prompt in prompts:
        for s in shapes:
            seq = list(prompt)

            def step(root, s=s, seq=seq):
                # The root is the last emitted token: the context is seq[:root + 1].
                context = torch.tensor(seq[: root + 1])
                _, features = target.forward_uncached(context[None])
                base = draft_entries(draft, context[1:], features[0, :-1])
                t = select_tree(draft, s, draft_expansions(draft, root, base, s.k, s.topk))
                acc = tree_lib.accept_greedy(t, target_tree_logits(target, context, t)[None])
                a = int(acc.count[0])
                seq.extend(tree_lib.emitted(t, acc)[0, : a + 1].tolist())
                return a

            greedy_first = int(target.forward_uncached(torch.tensor(prompt)[None])[0][0, -1].argmax())
            seq.append(greedy_first)
            results[s].append(decode(len(prompt), new_tokens, step))
    return results


def summary(shape: tree_lib.TreeShape, accepted: list[list[int]]) -> dict:
    flat = [a for row in accepted for a in row]
    return {"k": shape.k, "topk": shape.topk, "draft_tokens": shape.draft_tokens, "verify_tokens": shape.verify_tokens,
            "verify_steps": len(flat), "mean_accepted": sum(flat) / len(flat),
            "accept_length": sum(a + 1 for a in flat) / len(flat),
            "accept_histogram": [flat.count(i) for i in range(shape.k + 1)]}


def markdown(rows: list[dict]) -> str:
    chain = {r["k"]: r["accept_length"] for r in rows if r["topk"] == 1}
    lines = ["| depth k | topk | draft tokens | verify tokens | steps | accept length | vs chain of k |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['k']} | {r['topk']} | {r['draft_tokens']} | {r['verify_tokens']} | {r['verify_steps']} | "
                     f"{r['accept_length']:.3f} | {r['accept_length'] / chain[r['k']]:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts (training.held_out_prompts, seed 0)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt, as `dcp-compile eval` counts them")
    p.add_argument("--check-k", type=int, default=5, help="depth of the chain checked against dcp-compile eval")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: 2 prompts, 32 tokens, {QUICK_CONFIGS}, chain check at k=3")
    p.add_argument("--out", type=Path, help="write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.check_k = 2, 32, 3
        shapes = [tree_lib.TreeShape(*c) for c in QUICK_CONFIGS]
    else:
        shapes = configs()
    if tree_lib.TreeShape(args.check_k, 1, args.check_k) not in shapes:
        shapes.insert(0, tree_lib.TreeShape(args.check_k, 1, args.check_k))
    torch.set_grad_enabled(False)
    started = time.perf_counter()
    prompts = training.held_out_prompts(args.prompts, 192)
    max_seq_len = max(map(len, prompts)) + args.new_tokens + 2 * max(s.k for s in shapes) + 2
    target, draft = load_pair(MODEL, max_batch=1, max_seq_len=max_seq_len, device="cpu", dtype=torch.float32)

    results = run_continuation(target, draft, prompts, args.new_tokens, shapes)
    rows = [summary(s, results[s]) for s in shapes]
    report = {
        "model": MODEL, "dtype": "float32", "device": "cpu", "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "prompts": args.prompts, "prompt_bytes": 192, "new_tokens": args.new_tokens, "scoring": "continuation",
        "accept_length": "tokens emitted per verify step (accepted drafts + 1), mean over steps",
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
    }

    # The paths scoring on a prefix of the run: the same steps, so the same counts.
    checked = shapes if args.quick else [s for s in shapes if (s.k, s.topk, s.draft_tokens) in PATHS_CHECKED]
    paths_tokens = 8 if args.quick else 32
    paths = run_paths(target, draft, prompts[:1], paths_tokens, checked)
    agree = all(paths[s][0] == results[s][0][: len(paths[s][0])] for s in checked)
    report["paths_check"] = {
        "prompts": 1, "new_tokens": paths_tokens, "configs": [dataclasses.astuple(s) for s in checked],
        "accepted": {str(dataclasses.astuple(s)): paths[s][0] for s in checked}, "agree": agree,
    }
    print(f"paths scoring (every step from scratch) on prompt 0, {paths_tokens} tokens, "
          f"{[dataclasses.astuple(s) for s in checked]}: {'the same' if agree else 'DIFFERENT'} accept counts")
    assert agree, report["paths_check"]

    chain = tree_lib.TreeShape(args.check_k, 1, args.check_k)
    reference = summary(chain, results[chain])
    served = training.measure_acceptance(MODEL, device="cpu", k=args.check_k, n_prompts=args.prompts,
                                         new_tokens=args.new_tokens)
    passed = (served["verify_steps"], served["accept_histogram"]) == (reference["verify_steps"],
                                                                      reference["accept_histogram"])
    report["chain_check"] = {
        "k": args.check_k, "reference": reference["accept_length"], "reference_histogram": reference["accept_histogram"],
        "eval": served["mean_accept_length"], "eval_histogram": served["accept_histogram"], "passed": passed,
    }
    print(f"chain check, k={args.check_k}: reference {reference['accept_length']:.4f} "
          f"{reference['accept_histogram']}, dcp-compile eval {served['mean_accept_length']:.4f} "
          f"{served['accept_histogram']}: {'equal' if passed else 'DIFFERENT'}")
    assert passed, report["chain_check"]

    rows.sort(key=lambda r: (r["k"], r["topk"], r["draft_tokens"]))
    report["configs"] = rows
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(f"{args.prompts} held-out prompts x {args.new_tokens} new tokens, greedy, fp32 CPU, torch {torch.__version__}")
    print(markdown(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
