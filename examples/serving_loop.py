"""Your own serving loop over ``SpecEngine``: requests arrive over time, tokens stream, one is aborted.

The shipped ``tiny-code`` pair (a byte-level Llama target and its EAGLE3 draft) decodes
by chain speculation at k=4, the target sharded by DCP. The loop is what a server's
scheduler thread does: each step it adds the requests that arrived, calls
``engine.step()`` and streams every request's new tokens from the events it returns.
With two rows for three requests, the third waits in the queue until the abort of the
second frees a row. At the end every finished request's tokens are checked against the
same prompts decoded as one static batch (``dcp.generate_all``); the aborted one must be
a prefix of its own.

Every rank runs this same loop and makes the same calls (SPMD); rank 0 prints. (For a
server where only rank 0 takes requests, build ``SpecEngine(decoder, leader=True)`` and
run ``engine.follow()`` on the other ranks.)

    torchrun --standalone --nproc-per-node 2 examples/serving_loop.py

Two CPU ranks over gloo, about 30 s. On GPUs: ``--device cuda`` (NCCL, Inductor/Triton).
"""

import argparse

import dcp_compile as dcp
from dcp_compile.models.pretrained import load_pair
from dcp_compile.runtime.engine import SamplingParams, SpecEngine
from dcp_compile.text import ByteCodec

# step -> prompts arriving then; (step, request) aborts
ARRIVALS = {
    0: ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "import os\n\n\ndef list_python_files(root):\n"],
    2: ["class Point:\n    def __init__(self, x, y):\n        self.x = x\n"],
}
ABORT = (5, 1)
EOS = 0  # the shipped models' end-of-text byte


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    group = dcp.init_group(args.device)
    talk = group.rank == 0
    max_batch, max_seq_len = 2, 128
    target, draft = load_pair("tiny-code", max_batch=max_batch, max_seq_len=max_seq_len, device=group.device)
    decoder = dcp.SpecDecoder(target, draft, group, k=4, max_batch=max_batch, max_seq_len=max_seq_len, chunk_size=16,
                              lowering="aot_eager" if group.device.type == "cpu" else "inductor")
    engine = SpecEngine(decoder)
    codec = ByteCodec(EOS)
    prompts, tokens, ends, streams, accepted = {}, {}, {}, {}, []

    step = 0
    while engine.has_work() or step <= max(ARRIVALS):
        for text in ARRIVALS.get(step, []):
            rid = engine.add_request(codec.encode(text), SamplingParams(max_new_tokens=args.max_new_tokens, eos_id=EOS))
            prompts[rid], tokens[rid], streams[rid] = text, [], codec.decoder()
        if step == ABORT[0]:
            engine.abort(ABORT[1])
        events = engine.step()
        for rid, event in events.items():  # {request id: StepEvent(tokens, accepted, finished_by)}
            tokens[rid] += event.tokens
            accepted += event.accepted  # draft tokens the target took in this step's verify
            if event.finished_by:
                ends[rid] = event.finished_by
        if talk and events:
            print(f"step {step:2d}: " + " | ".join(
                f"[{rid}] +{streams[rid].push(e.tokens)!r}" + (f" ({e.finished_by})" if e.finished_by else "")
                for rid, e in events.items()), flush=True)
        step += 1

    static = dcp.generate_all(decoder, [codec.encode(prompts[rid]) for rid in sorted(prompts)], args.max_new_tokens, eos_id=EOS)
    for rid, out in enumerate(static):
        same = tokens[rid] == out.tokens if ends[rid] != "aborted" else tokens[rid] == out.tokens[: len(tokens[rid])]
        if not same:
            raise SystemExit(f"MISMATCH on rank {group.rank}: request {rid} streamed {tokens[rid]}, "
                             f"static {out.tokens}")
    if ends[ABORT[1]] != "aborted":
        raise SystemExit(f"request {ABORT[1]} was to be aborted, but ended by {ends[ABORT[1]]!r}")
    if talk:
        for rid in sorted(prompts):
            completion = bytes(t for t in tokens[rid] if t != EOS).decode(errors="replace")
            print(f"--- request {rid} ({ends[rid]}) ---\n{prompts[rid]}{completion}")
        print(f"OK: DCP size {group.size}, {len(prompts)} requests over {step} steps (request {ABORT[1]} aborted), "
              f"streamed tokens identical to a static batch, mean accept length "
              f"{sum(a + 1 for a in accepted) / len(accepted):.2f} at k=4")


if __name__ == "__main__":
    main()
