"""What Hugging Face users can get wrong under DCP is refused, with what and where."""

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.layout import KVLayout
from dcp_compile.passes import GraphPatternError, find, shard_attention
from dcp_compile.records import CacheRecord, register
from tests.support import capture_graph

pytest.importorskip("transformers")

from dcp_compile.hf import DCPCausalLM, DCPStaticCache, cache_kwarg  # noqa: E402
from tests.hf.workers import MAX_SEQ_LEN, hf_config, make_hf_model  # noqa: E402
from tests.passes import graphs  # noqa: E402


class OwnLoop(torch.nn.Module):
    """``model(input_ids, past_key_values=cache, **kwargs)`` as one traceable call."""

    def __init__(self, model, cache, **kwargs):
        super().__init__()
        self.model, self.cache, self.kwargs = model, cache, kwargs
        self.cache_kwarg = cache_kwarg(model)

    def forward(self, input_ids, *extra):
        kwargs = dict(self.kwargs, **({"attention_mask": extra[0]} if extra else {}))
        return self.model(input_ids=input_ids, **{self.cache_kwarg: self.cache}, **kwargs).logits


def sharding_error(model, *extra, tokens=3):
    cache = DCPStaticCache(model.config, None, max_batch_size=2, max_cache_len=MAX_SEQ_LEN)
    gm, _ = capture_graph(OwnLoop(model, cache), torch.ones(2, tokens, dtype=torch.long), *extra)
    plan = find(gm)
    with pytest.raises(GraphPatternError) as error:
        shard_attention(gm, plan, layout=KVLayout(2, 0, MAX_SEQ_LEN), group_name="g")
    return str(error.value)


@pytest.mark.parametrize(
    "family,overrides",
    [("mistral", dict(sliding_window=16)), ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1))],
)
def test_sliding_window_is_refused(family, overrides):
    message = sharding_error(make_hf_model(family, **overrides))
    assert "restricts the causal mask further" in message and "Sliding-window" in message
    assert "masking_utils.py" in message, "the error names the line that adds the window"


@pytest.mark.parametrize("width", [3, MAX_SEQ_LEN])
def test_padding_mask_is_a_key_mask(width):
    """The 2-D attention_mask HF users pass (as wide as the tokens so far, or as the
    cache): causal AND padding, proven, the padding kept as a key mask."""
    model = make_hf_model("llama")
    cache = DCPStaticCache(model.config, None, max_batch_size=2, max_cache_len=MAX_SEQ_LEN)
    gm, inputs = capture_graph(OwnLoop(model, cache), torch.ones(2, 3, dtype=torch.long), torch.ones(2, width, dtype=torch.long))
    plan = find(gm)
    assert all(s.mask.proven for s in plan.sites), [s.mask.failure for s in plan.sites]
    assert {n.name for s in plan.sites for n in s.mask.key_masks} == {"l_extra_0_"}


def test_prebuilt_4d_mask_is_refused_naming_the_fix():
    message = sharding_error(make_hf_model("llama"), torch.ones(2, 1, 3, MAX_SEQ_LEN, dtype=torch.bool))
    assert "4-D mask built outside the graph" in message and "compile_for_generate" in message


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_hf_masks_are_proven(family):
    """Prefill and decode graphs of the own-loop path: every layer's mask is proven."""
    model = make_hf_model(family)
    for tokens in (1, 4):
        cache = DCPStaticCache(model.config, None, max_batch_size=2, max_cache_len=MAX_SEQ_LEN)
        gm, inputs = capture_graph(OwnLoop(model, cache), torch.ones(2, tokens, dtype=torch.long))
        plan = find(gm)
        assert len(plan.sites) == 2 and all(s.mask.proven for s in plan.sites)
        # positions are arange(T) + cache.length: the host check knows how far they reach
        assert [(inputs[i] is cache.length, reach) for i, reach in plan.position_inputs] == [(True, tokens - 1)]


def test_own_loop_past_max_cache_len_is_refused_before_writing():
    """A sharded cache would send the overflow to the trash slot and answer wrongly; the
    backend's host check refuses the call instead (here on a group of one)."""
    model = make_hf_model("llama")
    group = dcp.init_group("cpu")
    cache = DCPStaticCache(model.config, group, max_batch_size=2, max_cache_len=MAX_SEQ_LEN)
    model_c = torch.compile(model, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True, dynamic=False)
    with torch.no_grad():
        model_c(input_ids=torch.ones(2, MAX_SEQ_LEN - 2, dtype=torch.long), **{cache_kwarg(model): cache})
        with pytest.raises(ValueError, match=rf"positions must lie in \[0, max_seq_len={MAX_SEQ_LEN}\), got values in "
                                             rf"\[{MAX_SEQ_LEN - 2}, {MAX_SEQ_LEN + 1}\]"):
            model_c(input_ids=torch.ones(2, 4, dtype=torch.long), **{cache_kwarg(model): cache})
        assert int(cache.length) == MAX_SEQ_LEN - 2, "nothing was written"


def test_a_cache_sized_for_other_heads_is_refused_naming_both_shapes():
    """A DCPStaticCache built from a config that is not the model's (here one KV head
    where the model has two) would fail deep in an index_copy_ under Dynamo."""
    model = make_hf_model("llama")
    other = hf_config("llama", num_key_value_heads=1)
    group = dcp.init_group("cpu")
    model_c = torch.compile(model, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True, dynamic=False)
    expected = r"layer 0 writes keys of 2 heads x 16 .* sized from the config for keys of 1 x 16"
    for forward in (model, model_c):
        cache = DCPStaticCache(other, group, max_batch_size=2, max_cache_len=MAX_SEQ_LEN)
        with torch.no_grad(), pytest.raises(Exception, match=expected):
            forward(input_ids=torch.ones(2, 3, dtype=torch.long), **{cache_kwarg(model): cache})
        assert int(cache.length) == 0 and not cache.store.k_0.any(), "nothing was written"


def test_wrapper_gives_the_model_back_without_its_hooks():
    model = make_hf_model("llama")
    layers = model.model.layers
    wrapper = DCPCausalLM(model, max_batch=2, max_seq_len=MAX_SEQ_LEN, aux_layers=(0, 1, 2))
    assert len(layers[0]._forward_pre_hooks) == 1 and len(model.model.norm._forward_hooks) == 1
    tokens = torch.ones(2, 3, dtype=torch.long)
    positions = torch.arange(3).expand(2, 3)
    with torch.no_grad():
        logits, features = wrapper(tokens, positions)
    assert features.shape == (2, 3, 3 * model.config.hidden_size)
    wrapper.remove_hooks()
    assert not layers[0]._forward_pre_hooks and not model.model.norm._forward_hooks
    wrapper.cache.reset()
    with torch.no_grad():
        again = wrapper(tokens, positions)  # logits alone now, with the same values
    torch.testing.assert_close(again, logits)


def test_wrapper_refuses_sliding_window_and_other_attention():
    with pytest.raises(ValueError, match="sliding-window"):
        DCPCausalLM(make_hf_model("mistral", sliding_window=16), max_batch=2, max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        DCPCausalLM(make_hf_model("llama", attn_implementation="eager"), max_batch=2, max_seq_len=MAX_SEQ_LEN)


class CrossAttention(graphs.GptFastStyle):
    """Self-attention over its own cache, plus attention over encoder K/V held in a
    cache buffer that this (decode) graph reads but never writes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("enc_k", torch.randn(graphs.B, graphs.HKV, graphs.S, graphs.D))
        self.register_buffer("enc_v", torch.randn(graphs.B, graphs.HKV, graphs.S, graphs.D))

    def forward(self, x, input_pos):
        out = super().forward(x, input_pos)
        q = self.wq(x).view(graphs.B, x.shape[1], graphs.HQ, graphs.D).transpose(1, 2)
        cross = torch.nn.functional.scaled_dot_product_attention(q, self.enc_k, self.enc_v, enable_gqa=True)  # CROSS
        return out + cross


def test_cross_attention_over_a_sharded_cache_is_refused():
    module = CrossAttention()
    group = dcp.DCPGroup(2, 0, torch.device("cpu"), None)  # never communicates: the backend refuses first
    layout = KVLayout(2, 0, graphs.S)
    for name in ("k_cache", "v_cache", "enc_k", "enc_v"):
        register(getattr(module, name), CacheRecord(name, "target", 2, layout, (graphs.B, graphs.HKV, graphs.S, graphs.D)))
    compiled = torch.compile(module, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True)
    with pytest.raises(Exception, match="cross-attention") as error, torch.no_grad():
        compiled(*graphs.inputs_for(module))
    assert "enc_k" in str(error.value) and "CROSS" in str(error.value)


def test_a_sharded_cache_written_outside_a_dcp_graph_is_refused_before_the_write():
    from dcp_compile.runtime.launch import spawn_ranks
    from tests.support import FP32_TOLERANCE
    from tests.hf.workers import hf_refusal_worker

    for r in spawn_ranks(hf_refusal_worker, 2, timeout=600):
        for route, error in r["errors"].items():
            assert error is not None and "did not go through a graph compiled by dcp.backend" in error, (route, error)
        assert all(r["untouched"].values()), r["untouched"]
        torch.testing.assert_close(r["logits"], r["reference"], **FP32_TOLERANCE)
        assert "batch of 3 rows, but the model was prepared for max_batch=2" in r["batch_error"]


def test_gemma2_logit_softcapping_is_refused_naming_the_tanh():
    """Gemma-2 squashes the scores, tanh(scores / cap) * cap, before the softmax: not a
    scale or mask the passes can carry to each shard's partial, so the attention is refused."""
    model = make_hf_model("gemma2")
    cache = DCPStaticCache(model.config, None, max_batch_size=2, max_cache_len=MAX_SEQ_LEN)
    gm, _ = capture_graph(OwnLoop(model, cache), torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(GraphPatternError, match=r"modeling_gemma2.py:\d+: attn_weights = nn.functional.softmax.* is "
                                                r"taken of 'tanh' .*, not of q @ k.transpose"):
        find(gm)


def test_an_eagle_draft_for_a_latent_attention_model_asks_for_its_shapes():
    """DeepSeek's config gives no Llama head width for a draft (its head_dim is the rope
    key's): draft_config says so rather than size a draft from the rope width."""
    wrapper = DCPCausalLM(make_hf_model("deepseek_v3"), max_batch=2, max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(ValueError, match=r"DeepseekV3Config uses multi-head latent attention \(kv_lora_rank=32\); an "
                                         r"EAGLE draft is a Llama decoder layer"):
        wrapper.draft_config("eagle3")


def test_deepseek_v32_sparse_attention_is_refused_naming_the_indexer():
    """DeepSeek-V3.2's layers attend to the cached slots an indexer picks per token: not a
    cache whose shards an exact merge can combine."""
    import transformers

    config = transformers.DeepseekV32Config(num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"DeepseekV32Config has layer types \['(indexed|deepseek_sparse)_attention'\] "
                                         r"\(\w+: an indexer picks the cached slots each token attends to"):
        DCPStaticCache(config, None, max_batch_size=2, max_cache_len=MAX_SEQ_LEN)
