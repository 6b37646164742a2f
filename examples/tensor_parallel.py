"""DCP inside tensor parallelism: four ranks hold a quarter of the target's heads each, and
each pair of ranks shards the KV head they share by token.

The shipped ``tiny-code`` target has 4 query heads over 2 KV heads. ``dcp.init_group(tp=4,
dcp=2)`` makes the 4 ranks one TP group and two DCP groups, {0, 1} and {2, 3}.
``dcp.tensor_parallel`` gives rank r query head r and KV head r // 2: each KV head is held by
two ranks, and DCP shards that copy by token, so each rank caches one KV head and half of
the positions. Its EAGLE3 draft stays whole on every rank. Rank 0 then decodes the same
prompts with the unsharded models on its own and checks the tokens and accept counts
(exactly, in fp32).

    torchrun --standalone --nproc-per-node 4 examples/tensor_parallel.py

Four CPU ranks over gloo, about a minute on 2 cores. On GPUs: ``--device cuda`` (NCCL,
Inductor/Triton).
"""

import argparse

import dcp_compile as dcp
from dcp_compile.models.pretrained import load_pair
from dcp_compile.text import ByteCodec

PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', "import os\n\n\ndef list_python_files(root):\n"]
EOS = 0  # the shipped models' end-of-text byte


def decode(group, max_new_tokens: int, *, shard: bool):
    max_batch, max_seq_len = len(PROMPTS), 128
    target, draft = load_pair("tiny-code", max_batch=max_batch, max_seq_len=max_seq_len, device=group.device)
    if shard:
        dcp.tensor_parallel(target, group)  # before prepare: the caches are laid out for this rank's heads
    decoder = dcp.SpecDecoder(target, draft, group, k=4, max_batch=max_batch, max_seq_len=max_seq_len, chunk_size=32,
                              lowering="aot_eager" if group.device.type == "cpu" else "inductor")
    outputs = dcp.generate_all(decoder, [ByteCodec(EOS).encode(p) for p in PROMPTS], max_new_tokens, eos_id=EOS)
    cache = tuple(target.layers[0].attention.k_cache.shape)
    return outputs, cache


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    group = dcp.init_group(args.device, tp=4, dcp=2)
    outputs, cache = decode(group, args.max_new_tokens, shard=True)
    if group.tp_rank != 0:
        return
    off, whole = decode(dcp.DCPGroup(1, 0, group.device, None), args.max_new_tokens, shard=False)
    for prompt, out, ref in zip(PROMPTS, outputs, off):
        if out.tokens != ref.tokens or out.accepted != ref.accepted:
            raise SystemExit(f"MISMATCH: TP 4 x DCP 2 decoded {out.tokens} ({out.accepted}), the unsharded model "
                             f"{ref.tokens} ({ref.accepted})")
        print(f"--- {out.finished_by} ---\n{prompt}{bytes(t for t in out.tokens if t != EOS).decode(errors='replace')}")
    steps = [a for o in outputs for a in o.accepted]
    print(f"OK: TP 4 x DCP 2, rank 0 caches {cache} (rows, KV heads, slots, head dim) of the unsharded {whole}, "
          f"tokens and accept counts identical to the unsharded models, mean accept length "
          f"{sum(a + 1 for a in steps) / len(steps):.2f} at k=4")


if __name__ == "__main__":
    main()
