"""What the backend refuses before it runs a pass, with what and where.

Each test captures a small module's graph and hands it to the backend, as Dynamo would.
The KV caches are registered by hand, as ``dcp.prepare`` would have left them; the
group of two never communicates, because the backend refuses first.
"""

import pytest
import torch
import torch.nn.functional as F

import dcp_compile as dcp
from dcp_compile.layout import KVLayout
from dcp_compile.passes import GraphPatternError
from dcp_compile.records import CacheRecord, register
from tests.support import capture_graph
from tests.passes import graphs
from tests.passes.graphs import B, D, HKV, HQ, S

CPU = torch.device("cpu")


def prepared(module, size: int, names=("k_cache", "v_cache")):
    """``module`` with its caches registered for a target group of ``size`` ranks."""
    for name in names:
        buffer = getattr(module, name)
        register(buffer, CacheRecord(name, "target", 2, KVLayout(size, 0, S), tuple(buffer.shape)))
    return module


def target_backend(size: int):
    return dcp.backend(dcp.DCPGroup(size, 0, CPU, None), "target", lowering="aot_eager")


class CrossAttention(graphs.GptFastStyle):
    """Self-attention over its own cache, plus attention over encoder keys and values
    held in cache buffers that this decode graph reads but never writes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("enc_k", torch.zeros(B, HKV, S, D))
        self.register_buffer("enc_v", torch.zeros(B, HKV, S, D))

    def forward(self, x, input_pos):
        out = super().forward(x, input_pos)
        q = self.wq(x).view(B, x.shape[1], HQ, D).transpose(1, 2)
        return out + F.scaled_dot_product_attention(q, self.enc_k, self.enc_v, enable_gqa=True)


class AttendsToNewTokensOnly(graphs.GptFastStyle):
    """Stores the new keys and values, then attends to them instead of the cache."""

    def forward(self, x, input_pos):
        q, k, v = self.store(x, input_pos)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_a_sharded_cache_read_without_a_write_is_refused():
    module = prepared(CrossAttention(), 2, names=("k_cache", "v_cache", "enc_k", "enc_v"))
    gm, inputs = capture_graph(module, *graphs.inputs_for(module))
    with pytest.raises(GraphPatternError, match="KV cache enc_k holds only this rank's shard") as error:
        with torch.no_grad():
            target_backend(2)(gm, inputs)
    assert "cross-attention" in str(error.value)
    assert "test_backend_refusals.py:" in str(error.value) and "self.enc_k, self.enc_v" in str(error.value), (
        "the error names the line that reads the cache"
    )


def test_a_mask_table_prepare_did_not_check_is_refused():
    module = prepared(graphs.GptFastStyle(), 2)  # causal_mask left unregistered
    gm, inputs = capture_graph(module, *graphs.inputs_for(module))
    table = next(i for i, t in enumerate(inputs) if t is module.causal_mask)
    expected = f"graph input {table} is a causal-mask table .* that dcp.prepare did not check"
    with pytest.raises(ValueError, match=expected), torch.no_grad():
        target_backend(2)(gm, inputs)


def test_a_target_compiled_with_grad_on_is_refused():
    module = prepared(graphs.GptFastStyle(), 1)
    gm, inputs = capture_graph(module, *graphs.inputs_for(module))
    backend = target_backend(1)
    with pytest.raises(ValueError, match="compiles inference graphs; call the compiled target under torch.no_grad"):
        backend(gm, inputs)
    with torch.no_grad():
        backend(gm, inputs)
    assert len(backend.compiled) == 1, "under no_grad the same graph compiles"


def test_a_target_without_attention_over_its_cache_is_refused():
    module = prepared(AttendsToNewTokensOnly(), 1)
    gm, inputs = capture_graph(module, *graphs.inputs_for(module))
    with pytest.raises(ValueError, match="the target graph holds no attention over a KV cache"), torch.no_grad():
        target_backend(1)(gm, inputs)



def test_the_kernels_choice_is_checked_and_holds_only_while_a_graph_lowers():
    from dcp_compile.ops.inlining import kernels_inlined, lowering_kernels

    with pytest.raises(ValueError, match="kernels must be one of"):
        dcp.backend(dcp.DCPGroup(1, 0, CPU, None), kernels="fused")
    assert kernels_inlined()
    with lowering_kernels("opaque"):
        assert not kernels_inlined()
        with lowering_kernels("inline"):
            assert kernels_inlined()
        assert not kernels_inlined()
    assert kernels_inlined()
