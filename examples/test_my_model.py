"""Check that your model's attention is found, sharded and exact under DCP, on 2 gloo ranks.

Copy this file beside your model, replace ``MyModel`` (and ``make_model`` / ``calls`` if its
forward takes other arguments), and run it with pytest:

    python -m pytest -q examples/test_my_model.py

Two tests over one run of 2 CPU ranks (spawned with ``spawn_ranks``, about 15 s):

- numerical: the prepared model compiled by ``dcp.backend`` on 2 ranks gives what the same
  model gives eagerly and unsharded, call by call (prefill, then decode steps), in fp32;
- structural: every compiled graph found one attention site per layer, and the passes
  rewrote each into the DCP form (this rank's prefix attention, one all-gather, an exact
  merge with the attention over the step's new tokens), leaving no SDPA behind.

A model the passes cannot shard fails here at compile time, with the FX node and your
source line.
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dcp_compile as dcp
from dcp_compile.runtime.launch import spawn_ranks

MAX_BATCH, MAX_SEQ_LEN, N_LAYERS = 2, 32, 2
FP32_TOLERANCE = dict(rtol=1.3e-6, atol=1e-5)


class MyModel(nn.Module):
    """Replace with your model. Its KV caches are registered buffers written at the step's
    positions (here ``index_copy_`` along the sequence axis of ``[B, H_kv, S, D]``); its
    attention reads them (here SDPA under a mask built from positions)."""

    def __init__(self, vocab=64, dim=32, n_heads=4, n_kv_heads=2):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.embed = nn.Embedding(vocab, dim)
        self.wqkv = nn.ModuleList(nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim) for _ in range(N_LAYERS))
        self.wo = nn.ModuleList(nn.Linear(dim, dim) for _ in range(N_LAYERS))
        self.head = nn.Linear(dim, vocab)
        for i in range(N_LAYERS):  # [B, H_kv, S, D]
            self.register_buffer(f"k_cache_{i}", torch.zeros(MAX_BATCH, n_kv_heads, MAX_SEQ_LEN, self.head_dim))
            self.register_buffer(f"v_cache_{i}", torch.zeros(MAX_BATCH, n_kv_heads, MAX_SEQ_LEN, self.head_dim))

    def forward(self, tokens, input_pos):
        """``tokens [B, T]`` at ``input_pos [T]`` -> logits ``[B, T, vocab]``."""
        B, T = tokens.shape
        x = self.embed(tokens)
        for i in range(N_LAYERS):
            q, k, v = self.wqkv[i](x).view(B, T, -1, self.head_dim).transpose(1, 2).split(
                [self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=1)
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            k_cache.index_copy_(2, input_pos, k)
            v_cache.index_copy_(2, input_pos, v)
            mask = torch.arange(k_cache.shape[2])[None, :] <= input_pos[:, None]  # the cache's own length
            y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
            x = x + self.wo[i](y.transpose(1, 2).reshape(B, T, -1))
        return self.head(x)


def make_model(seed=0):
    torch.manual_seed(seed)  # the same weights on every rank, and for the reference
    return MyModel().eval()


def calls():
    """The forward calls to compare: a prefill of 7 tokens, then 5 decode steps."""
    gen = torch.Generator().manual_seed(1)
    yield torch.randint(0, 64, (MAX_BATCH, 7), generator=gen), torch.arange(7)
    for pos in range(7, 12):
        yield torch.randint(0, 64, (MAX_BATCH, 1), generator=gen), torch.tensor([pos])


def dcp_worker(rank, size):
    """One rank: the model prepared and compiled under DCP, and the same model eager and unsharded."""
    group = dcp.init_group("cpu")
    model, reference = make_model(), make_model()
    dcp.prepare(model, group, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)
    backend = dcp.backend(group, lowering="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    outs, refs = [], []
    with torch.no_grad():
        for args in calls():
            outs.append(compiled(*args))
            refs.append(reference(*args))
    graphs = [dict(sites=len(g.plan.sites), ops=Counter(getattr(n.target, "__name__", str(n.target))
                                                        for n in g.graph_module.graph.nodes if n.op == "call_function"))
              for g in backend.compiled]  # what the passes found, and the ops of the graph they left
    return dict(outs=outs, refs=refs, collectives=backend.collective_counts, graphs=graphs)


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(dcp_worker, 2, timeout=600)


def test_sharded_model_matches_unsharded(ranks):
    for rank, result in enumerate(ranks):
        for step, (out, ref) in enumerate(zip(result["outs"], result["refs"])):
            torch.testing.assert_close(out, ref, **FP32_TOLERANCE, msg=lambda m: f"rank {rank}, call {step}: {m}")


def test_every_attention_is_sharded(ranks):
    result = ranks[0]
    assert len(result["graphs"]) == 2, "one graph for the prefill, one for the decode steps"
    assert result["collectives"] == [2 * N_LAYERS] * 2, "an all-gather and its wait per layer"
    for graph in result["graphs"]:
        assert graph["sites"] == N_LAYERS, "every layer's attention found"
        ops = graph["ops"]
        assert ops["prefix_attention.default"] == N_LAYERS, "attention over this rank's slots of the cache"
        assert ops["all_gather_into_tensor.default"] == N_LAYERS, "every rank's partial result, gathered"
        assert ops["window_attention.default"] == N_LAYERS, "attention over the step's new tokens"
        assert ops["merge_gathered"] == N_LAYERS, "the exact log-sum-exp merge"
        assert not any("scaled_dot_product_attention" in op for op in ops), "no attention left unsharded"
