"""Chains and tree drafts on a GPU: Inductor graphs, the Triton kernels and CUDA graphs
(the whole step in one graph, and the step's calls captured one by one) give the tokens of
the uncaptured run and, for greedy rows, the target's own greedy tokens.

    python3 benchmarks/gpu_tree_check.py        # one GPU; prints one line per check, exits 1 on a failure
"""

from __future__ import annotations

import sys

import torch

import dcp_compile as dcp
from dcp_compile.runtime.engine import SamplingParams, SpecEngine
from tests.support import agreeing_pair

TEMPERATURES = (0.0, 0.0, 0.8, 0.8)


def decode(run: dict, device, seeded: bool = True) -> tuple[list, list]:
    """Tokens and accept counts of four requests (``TEMPERATURES``); ``seeded``: each
    request draws from a generator of its own (else the batch's shared one)."""
    torch._dynamo.reset()
    target, draft = agreeing_pair("eagle3", noise=3.0)
    target, draft = target.to(device), draft.to(device)
    decoder = dcp.SpecDecoder(target, draft if run["k"] else None, dcp.DCPGroup(1, 0, device, None), max_batch=4,
                              max_seq_len=96, seed=11, lowering="inductor", **run)
    engine = SpecEngine(decoder)
    gen = torch.Generator().manual_seed(1)
    ids = [engine.add_request(torch.randint(0, 32, (n,), generator=gen).tolist(),
                              SamplingParams(max_new_tokens=24, temperature=t, seed=100 + i if seeded else None))
           for i, (n, t) in enumerate(zip((3, 9, 14, 20), TEMPERATURES))]
    tokens, accepted = {i: [] for i in ids}, {i: [] for i in ids}
    while engine.has_work():
        for request, event in engine.step().items():
            tokens[request] += event.tokens
            accepted[request] += event.accepted
    step_graph = decoder.device_step.step_graph
    if run.get("cuda_graphs") and run.get("step_graph", True):
        # the whole step was captured: one graph per (sampling, seeded) and every step a replay of one
        assert step_graph is not None and step_graph.captures == len(step_graph.steps) >= 1, "no whole-step capture"
        assert step_graph.replays == decoder.device_step.verify_steps, "a step ran outside the step graph"
    return [tokens[i] for i in ids], [accepted[i] for i in ids]


def main() -> int:
    device = torch.device("cuda")
    plain, _ = decode(dict(k=0), device)
    failures = 0
    for shape in (dict(k=4), dict(k=4, topk=3, draft_tokens=10), dict(k=6, topk=4, draft_tokens=24)):
        eager = decode(shape, device)
        whole = decode(shape | dict(cuda_graphs=True), device)
        calls = decode(shape | dict(cuda_graphs=True, step_graph=False), device)
        checks = {
            "one graph per step == uncaptured (tokens, accepts)": whole == eager,
            "calls captured one by one == uncaptured": calls == eager,
            "greedy rows == target greedy": all(whole[0][i] == plain[i] for i in (0, 1)),
            "sampled rows differ from greedy somewhere": any(whole[0][i] != plain[i] for i in (2, 3)),
        }
        if shape.get("topk", 1) == 3:  # the batch's shared generator alone, in the graph
            checks["unseeded: one graph per step == uncaptured"] = (
                decode(shape | dict(cuda_graphs=True), device, seeded=False) == decode(shape, device, seeded=False))
        mean = sum(sum(a) for a in whole[1]) / sum(len(a) for a in whole[1])
        for name, ok in checks.items():
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} {shape}: {name}", flush=True)
        print(f"     {shape}: mean accepted {mean:.3f}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
