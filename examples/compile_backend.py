"""Your own model under DCP: ``dcp.prepare`` + ``torch.compile(backend=dcp.backend(group))``.

A tiny Llama-style model written the gpt-fast way (registered KV-cache buffers written
with ``index_copy_``, SDPA with a mask built from positions) knows nothing of DCP. Each
rank shards its caches, compiles it with the DCP backend, prefills a batch and decodes a
few greedy tokens, then checks the tokens (exactly) and the logits (fp32 tolerance)
against the same model run eagerly and unsharded in the same process.

    torchrun --standalone --nproc-per-node 2 examples/compile_backend.py

Two CPU ranks over gloo, about 15 s. On GPUs: ``--device cuda`` (NCCL, Inductor/Triton).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import dcp_compile as dcp


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, max_batch, max_seq_len):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        cache_shape = (max_batch, n_kv_heads, max_seq_len, self.head_dim)  # [B, H_kv, S, D]
        self.register_buffer("k_cache", torch.zeros(cache_shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape), persistent=False)

    def forward(self, x, input_pos, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split([self.n_heads * self.head_dim, *[self.n_kv_heads * self.head_dim] * 2], dim=-1)
        q = rope(q.view(B, T, self.n_heads, self.head_dim), cos, sin).transpose(1, 2)
        k = rope(k.view(B, T, self.n_kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        # Sized from the cache's own length, not max_seq_len: under DCP it holds this rank's slots.
        mask = torch.arange(self.k_cache.shape[2], device=x.device)[None, :] <= input_pos[:, None]  # [T, S]
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def rope(x, cos, sin):
    """Rotate the pairs (x[..., ::2], x[..., 1::2]) of ``x [B, T, H, D]`` by ``cos, sin [T, D/2]``."""
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None], sin[None, :, None]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, dim, *cache_args):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.attention = Attention(dim, *cache_args)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x, input_pos, cos, sin):
        h = x + self.attention(self.attention_norm(x), input_pos, cos, sin)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class TinyLlama(nn.Module):
    def __init__(self, vocab=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_batch=2, max_seq_len=64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, max_batch, max_seq_len) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        half = dim // n_heads // 2
        self.register_buffer("inv_freq", 10000.0 ** (-torch.arange(half) / half), persistent=False)

    def forward(self, idx, input_pos):
        """``idx [B, T]`` at ``input_pos [T]`` (shared by the batch, as in gpt-fast) -> logits [B, T, V]."""
        angles = input_pos[:, None].float() * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, cos, sin)
        return self.output(self.norm(x))


def build(device, seed=0):
    torch.manual_seed(seed)
    return TinyLlama().to(device).eval()


@torch.no_grad()
def greedy(model, prompt, steps):
    """Prefill ``prompt [B, T]``, then ``steps`` greedy decode steps; tokens [B, steps+1], logits [steps+1, B, V]."""
    T = prompt.shape[1]
    logits = [model(prompt, torch.arange(T, device=prompt.device))[:, -1]]
    for step in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        logits.append(model(token, torch.tensor([T + step], device=prompt.device))[:, -1])
    logits = torch.stack(logits)
    return logits.argmax(-1).T, logits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    group = dcp.init_group(args.device)
    model, reference = build(group.device), build(group.device)
    dcp.prepare(model, group, max_batch=2, max_seq_len=64)  # this rank's shard of every cache
    backend = dcp.backend(group, lowering="aot_eager" if group.device.type == "cpu" else "inductor")
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)

    prompt = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(group.device)
    tokens, logits = greedy(compiled, prompt, args.steps)
    ref_tokens, ref_logits = greedy(reference, prompt, args.steps)

    if not torch.equal(tokens, ref_tokens):
        raise SystemExit(f"MISMATCH on rank {group.rank}: tokens {tokens.tolist()} != unsharded {ref_tokens.tolist()}")
    rtol, atol = (1.3e-6, 1e-5) if group.device.type == "cpu" else (1e-4, 1e-4)  # fp32; Inductor reorders sums
    torch.testing.assert_close(logits, ref_logits, rtol=rtol, atol=atol)  # raises (exit 1) on a mismatch
    if group.rank == 0:
        print(f"graphs compiled: {len(backend.compiled)}, collectives per graph: {backend.collective_counts}")
        print(f"OK: DCP size {group.size}, prefill + {args.steps} decode steps: tokens identical to the unsharded "
              f"model, logits within rtol={rtol}, atol={atol} (max |diff| {(logits - ref_logits).abs().max():.1e})")


if __name__ == "__main__":
    main()
