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


@pytest.mark.gpu
def test_latent_attention_decode_step_captures_in_a_cuda_graph():
    """Keys 24 and values 16 wide run the Triton kernels padded on the device, so a
    compiled decode step captures in a CUDA graph (the reference reads kv_len's largest
    value on the host, which a capture refuses) and its replays give the eager loop's
    tokens.  ``check_positions=False``: the backend's check of each call's positions
    reads them on the host too; a loop that captures its steps bounds them itself.  Both
    layers dense: transformers' routed experts in fp32 take a fallback that syncs."""
    from transformers import StaticCache

    from dcp_compile.hf import DCPStaticCache, cache_kwarg

    device = torch.device("cuda", 0)
    torch._dynamo.reset()
    model = make_hf_model("deepseek_v3", first_k_dense_replace=2).to(device)
    kwarg = cache_kwarg(model)
    prompt = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3)).to(device)
    group = dcp.DCPGroup(1, 0, device, None)
    backend = dcp.backend(group, cascade=True, lowering="inductor", check_positions=False)
    model_c = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)

    def new_cache():
        return DCPStaticCache(model.config, group, max_batch_size=2, max_cache_len=MAX_SEQ_LEN, device=device)

    steps = 8
    with torch.no_grad():
        ref_tokens, _ = own_loop(model, prompt, steps, {kwarg: StaticCache(config=model.config, max_cache_len=MAX_SEQ_LEN)})
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile the prefill and decode graphs on a cache of their own
            own_loop(model_c, prompt, 1, {kwarg: new_cache()})
        torch.cuda.current_stream().wait_stream(side)

        cache = new_cache()
        ids = model_c(input_ids=prompt, **{kwarg: cache}).logits[:, -1].argmax(-1)[:, None]
        tokens = [ids[:, 0]]
        static_ids = ids.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = model_c(input_ids=static_ids, **{kwarg: cache}).logits
        for _ in range(steps):
            graph.replay()
            static_ids.copy_(static_logits[:, -1].argmax(-1)[:, None])
            tokens.append(static_ids[:, 0].clone())
    assert torch.equal(torch.stack(tokens, dim=1), ref_tokens)
