"""A gpt-fast model file, unchanged, sharded under DCP and checked against its own eager output.

The model module is loaded from a path (``--model-file``): gpt-fast's ``model.py``, or the
copy kept in this repository's tests, the default. Nothing in it knows of DCP: its
``KVCache.update`` writes ``k_out[:, :, input_pos] = k_val``, ``forward`` indexes a causal-mask
tensor by ``input_pos`` (1-D, shared by the batch) and attention is SDPA after a
``repeat_interleave``. ``dcp.prepare`` shards the caches (and the mask table's columns), and
the backend rewrites each attention. Each rank prefills a batch and decodes greedily in
gpt-fast's own calling convention, then checks the tokens (exactly) and the logits (fp32
tolerance) against a second instance run eagerly and unsharded.

    torchrun --standalone --nproc-per-node 2 examples/gpt_fast.py --model-file tests/hf/gpt_fast_model.py

Two CPU ranks over gloo, about 15 s. On GPUs: ``--device cuda`` (NCCL, Inductor/Triton).
The model is built tiny (``ModelArgs`` fields below), whatever the file's defaults.
"""

import argparse
import importlib.util
import sys

import torch

import dcp_compile as dcp

TINY = dict(block_size=64, vocab_size=128, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128)


def load_module(path):
    spec = importlib.util.spec_from_file_location("gpt_fast_model", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def generate(model, prompt, steps):
    """gpt-fast's prefill + decode_one_token, greedy: tokens [B, steps+1], logits [steps+1, B, V]."""
    T = prompt.shape[1]
    logits = [model(prompt, torch.arange(T, device=prompt.device))[:, -1]]
    for step in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        logits.append(model(token, torch.tensor([T + step], device=prompt.device))[:, -1])
    logits = torch.stack(logits).float()
    return logits.argmax(-1).T, logits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-file", default="tests/hf/gpt_fast_model.py", help="gpt-fast's model.py")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    gpt_fast = load_module(args.model_file)

    group = dcp.init_group(args.device)
    batch, max_seq_len = 2, 64

    def build():
        torch.manual_seed(0)
        with torch.device(group.device):
            model = gpt_fast.Transformer(gpt_fast.ModelArgs(**TINY)).eval()
            model.setup_caches(batch, max_seq_len)
        return model

    model, reference = build(), build()
    dcp.prepare(model, group, max_batch=batch, max_seq_len=max_seq_len)
    backend = dcp.backend(group, lowering="aot_eager" if group.device.type == "cpu" else "inductor")
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)

    prompt = torch.randint(0, TINY["vocab_size"], (batch, 9), generator=torch.Generator().manual_seed(4))
    tokens, logits = generate(compiled, prompt.to(group.device), args.steps)
    ref_tokens, ref_logits = generate(reference, prompt.to(group.device), args.steps)

    if not torch.equal(tokens, ref_tokens):
        raise SystemExit(f"MISMATCH on rank {group.rank}: tokens {tokens.tolist()} != {ref_tokens.tolist()}")
    rtol, atol = (1.3e-6, 1e-5) if group.device.type == "cpu" else (1e-4, 1e-4)  # fp32; Inductor reorders sums
    torch.testing.assert_close(logits, ref_logits, rtol=rtol, atol=atol)  # raises (exit 1) on a mismatch
    if group.rank == 0:
        local = tuple(model.layers[0].attention.kv_cache.k_cache.shape)
        print(f"{args.model_file}: KV cache per rank {local}, collectives per graph: {backend.collective_counts}")
        print(f"OK: gpt-fast model file, DCP size {group.size}, prefill + {args.steps} decode steps: tokens identical "
              f"to the unsharded model, logits within rtol={rtol}, atol={atol} "
              f"(max |diff| {(logits - ref_logits).abs().max():.1e})")


if __name__ == "__main__":
    main()
