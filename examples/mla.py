"""A DeepSeek-style multi-head latent attention (MLA) model under DCP, against itself unsharded.

``dcp_compile.models.mla.MLATransformer`` writes attention the way serving code runs MLA
at decode (the absorbed form): per layer a ``[B, S, kv_lora_rank]`` latent cache and a
``[B, S, rope_dim]`` rope-key cache, scores from two einsums, the latent as the values.
The passes shard both caches along the sequence. Each rank greedy-decodes a ragged batch
(prefill, then decode steps at every sequence's own positions) and checks the tokens
(exactly) and the logits (fp32 tolerance) against the same model eager and unsharded.

    torchrun --standalone --nproc-per-node 2 examples/mla.py

Two CPU ranks over gloo, about 15 s. On GPUs: ``--device cuda`` (NCCL, Inductor/Triton).
"""

import argparse

import torch

import dcp_compile as dcp
from dcp_compile.models.llama import init_weights
from dcp_compile.models.mla import MLAConfig, MLATransformer
from dcp_compile.runtime.generate import greedy_decode


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    group = dcp.init_group(args.device)
    # DeepSeek-V3's attention in miniature: a low-rank query, a 32-wide latent and an 8-wide rope key.
    cfg = MLAConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, q_lora_rank=24, kv_lora_rank=32,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_batch=3, max_seq_len=48)
    model, reference = (init_weights(MLATransformer(cfg), seed=0, std=0.2).to(group.device).eval() for _ in range(2))
    dcp.prepare(model, group, max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
    backend = dcp.backend(group, lowering="aot_eager" if group.device.type == "cpu" else "inductor")
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist() for n in (4, 9, 13)]
    out = greedy_decode(compiled, prompts, args.steps, device=group.device)
    ref = greedy_decode(reference, prompts, args.steps, device=group.device)

    if not torch.equal(out.tokens, ref.tokens):
        raise SystemExit(f"MISMATCH on rank {group.rank}: tokens {out.tokens.tolist()} != {ref.tokens.tolist()}")
    logits, ref_logits = torch.stack(out.logits), torch.stack(ref.logits)
    rtol, atol = (1.3e-6, 1e-5) if group.device.type == "cpu" else (1e-4, 1e-4)  # fp32; Inductor reorders sums
    torch.testing.assert_close(logits, ref_logits, rtol=rtol, atol=atol)  # raises (exit 1) on a mismatch
    if group.rank == 0:
        local = tuple(model.layers[0].attention.kv_cache.shape)
        print(f"latent cache per rank {local} (unsharded {tuple(reference.layers[0].attention.kv_cache.shape)}), "
              f"collectives per graph: {backend.collective_counts}")
        print(f"OK: MLA, DCP size {group.size}, ragged prefill + {args.steps} decode steps: tokens identical to the "
              f"unsharded model, logits within rtol={rtol}, atol={atol} "
              f"(max |diff| {(logits - ref_logits).abs().max():.1e})")


if __name__ == "__main__":
    main()
