"""Tree drafts on a GPU: Inductor graphs, the Triton kernels and CUDA graphs give the
tokens of the uncaptured run and, for greedy rows, the target's own greedy tokens.

    python3 benchmarks/gpu_tree_check.py        # one GPU; prints one line per check, exits 1 on a failure
"""

from __future__ import annotations

import sys

import torch

import dcp_compile as dcp
from dcp_compile.runtime.engine import SamplingParams, SpecEngine
from tests.support import agreeing_pair

TEMPERATURES = (0.0, 0.0, 0.8, 0.8)


def decode(run: dict, device) -> tuple[list, list]:
    torch._dynamo.reset()
    target, draft = agreeing_pair("eagle3", noise=3.0)
    target, draft = target.to(device), draft.to(device)
    decoder = dcp.SpecDecoder(target, draft if run["k"] else None, dcp.DCPGroup(1, 0, device, None), max_batch=4,
                              max_seq_len=96, seed=11, lowering="inductor", **run)
    engine = SpecEngine(decoder)
    gen = torch.Generator().manual_seed(1)
    ids = [engine.add_request(torch.randint(0, 32, (n,), generator=gen).tolist(),
                              SamplingParams(max_new_tokens=24, temperature=t, seed=100 + i))
           for i, (n, t) in enumerate(zip((3, 9, 14, 20), TEMPERATURES))]
    tokens, accepted = {i: [] for i in ids}, {i: [] for i in ids}
    while engine.has_work():
        for request, event in engine.step().items():
            tokens[request] += event.tokens
            accepted[request] += event.accepted
    return [tokens[i] for i in ids], [accepted[i] for i in ids]


def main() -> int:
    device = torch.device("cuda")
    plain, _ = decode(dict(k=0), device)
    failures = 0
    for shape in (dict(k=4, topk=3, draft_tokens=10), dict(k=6, topk=4, draft_tokens=24)):
        eager = decode(shape, device)
        captured = decode(shape | dict(cuda_graphs=True), device)
        checks = {
            "captured == uncaptured (tokens, accepts)": captured == eager,
            "greedy rows == target greedy": all(captured[0][i] == plain[i] for i in (0, 1)),
            "sampled rows differ from greedy somewhere": any(captured[0][i] != plain[i] for i in (2, 3)),
        }
        mean = sum(sum(a) for a in captured[1]) / sum(len(a) for a in captured[1])
        for name, ok in checks.items():
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} {shape}: {name}", flush=True)
        print(f"     {shape}: mean accepted {mean:.3f}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
