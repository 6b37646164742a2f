"""Transformers' latent attention through Inductor on a GPU: the single-GPU cascade
(``cascade=True``: prefix over the cache's expansion, window over its replay on the new
tokens, merge) against transformers' own eager loop with its ``StaticCache``."""

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.passes.shard_attention import WINDOW_ATTENTION

pytest.importorskip("transformers")

from tests.hf.workers import MAX_SEQ_LEN, VOCAB, make_hf_model, own_loop  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_latent_attention_cascade_on_the_gpu_matches_transformers(dtype):
    from transformers import StaticCache

    from dcp_compile.hf import DCPStaticCache, cache_kwarg

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    torch._dynamo.reset()
    model = make_hf_model("deepseek_v3").to(device=device, dtype=dtype)
    kwarg = cache_kwarg(model)
    prompt = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3)).to(device)
    group = dcp.DCPGroup(1, 0, device, None)
    backend = dcp.backend(group, cascade=True, lowering="inductor")
    model_c = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    cache = DCPStaticCache(model.config, group, max_batch_size=2, max_cache_len=MAX_SEQ_LEN, dtype=dtype, device=device)
    reference_cache = StaticCache(config=model.config, max_cache_len=MAX_SEQ_LEN)
    with torch.no_grad():
        tokens, logits = own_loop(model_c, prompt, 8, {kwarg: cache})
        ref_tokens, ref_logits = own_loop(model, prompt, 8, {kwarg: reference_cache})
    assert backend.collective_counts == [0, 0], "one GPU: the cascade without a collective, prefill and decode"
    assert all(any(n.target is WINDOW_ATTENTION for n in c.graph_module.graph.nodes) for c in backend.compiled)
    if dtype == torch.float32:
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    else:
        # bf16: the first step's logits, before any token can diverge
        torch.testing.assert_close(logits[0], ref_logits[0], rtol=0.05, atol=0.05)
