"""Transformers' own ``model.generate()`` under DCP, on a left-padded batch.

A tiny random ``LlamaForCausalLM`` is built in the script. ``compile_for_generate`` compiles
its forward with ``dcp.backend`` (prefill and decode alike), and a ``DCPStaticCache`` holds
this rank's shard of every layer's cache. The prompts have different lengths, padded on
the left with an attention mask, as Hugging Face users batch them. Every rank checks the
greedy tokens (exactly) and the step logits (fp32 tolerance) against transformers' own
``generate()`` with its ``StaticCache`` on the same model, unsharded and uncompiled.

    torchrun --standalone --nproc-per-node 2 examples/hf_generate.py

Two CPU ranks over gloo, about 20 s. On GPUs: ``--device cuda`` (NCCL, Inductor/Triton).
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

import dcp_compile as dcp
from dcp_compile.hf import DCPStaticCache, cache_kwarg, compile_for_generate

MAX_CACHE_LEN = 64


def left_padded(lengths, vocab, seed=5):
    """Prompts of ``lengths`` tokens, padded on the left with 0, and their attention mask."""
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    gen = torch.Generator().manual_seed(seed)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(1, vocab, (n,), generator=gen)
        mask[row, -n:] = 1
    return ids, mask


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()

    group = dcp.init_group(args.device)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_CACHE_LEN,
                         initializer_range=0.1, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(group.device).eval()
    ids, mask = (t.to(group.device) for t in left_padded((4, 9, 6), config.vocab_size))
    options = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0,
                   return_dict_in_generate=True, output_logits=True)
    kw = cache_kwarg(model)  # "cache" from transformers 5.24 on, "past_key_values" before

    with torch.no_grad():
        cache = StaticCache(config=config, max_cache_len=MAX_CACHE_LEN)
        reference = model.generate(ids, **{kw: cache}, disable_compile=True, **options)

        backend = compile_for_generate(model, group, lowering="aot_eager" if group.device.type == "cpu" else "inductor")
        cache = DCPStaticCache(config, group, max_batch_size=len(ids), max_cache_len=MAX_CACHE_LEN,
                               device=group.device)
        out = model.generate(ids, **{kw: cache}, **options)

    if not torch.equal(out.sequences, reference.sequences):
        raise SystemExit(f"MISMATCH on rank {group.rank}: {out.sequences.tolist()} != {reference.sequences.tolist()}")
    logits, ref_logits = torch.stack(out.logits), torch.stack(reference.logits)
    rtol, atol = (1.3e-6, 1e-5) if group.device.type == "cpu" else (1e-4, 1e-4)  # fp32; Inductor reorders sums
    torch.testing.assert_close(logits, ref_logits, rtol=rtol, atol=atol)  # raises (exit 1) on a mismatch
    if group.rank == 0:
        print(f"cache per rank {tuple(cache.store.k_0.shape)} of {MAX_CACHE_LEN} positions, collectives per graph: "
              f"{backend.collective_counts}")
        for row in out.sequences[:, ids.shape[1]:].tolist():
            print("  new tokens:", row)
        print(f"OK: generate() under DCP size {group.size}, left-padded batch of {len(ids)}: greedy tokens "
              f"identical to transformers' StaticCache generate(), logits within rtol={rtol}, atol={atol} "
              f"(max |diff| {(logits - ref_logits).abs().max():.1e})")


if __name__ == "__main__":
    main()
