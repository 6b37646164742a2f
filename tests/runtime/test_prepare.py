import math

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.models import LlamaConfig
from dcp_compile.runtime.launch import spawn_ranks
from tests.support import FP32_TOLERANCE, make_model
from tests.passes import graphs
from tests.runtime.workers import idiom_worker, layout_worker, mismatch_worker


@pytest.mark.parametrize("size,max_seq_len", [(2, 64), (3, 64), (4, 50)])
def test_target_caches_shrink_and_draft_caches_stay_whole(size, max_seq_len):
    cfg = LlamaConfig(max_seq_len=max_seq_len)
    for rank, r in enumerate(spawn_ranks(layout_worker, size, max_seq_len)):
        local = math.ceil(max_seq_len / size) + 1
        assert r["target_caches"] == [(cfg.max_batch, cfg.n_kv_heads, local, cfg.head_dim)] * (2 * cfg.n_layers)
        assert r["target_bytes"] == 2 * cfg.n_layers * cfg.max_batch * cfg.n_kv_heads * local * cfg.head_dim * 4
        assert r["draft_caches"] == [(cfg.max_batch, cfg.n_kv_heads, max_seq_len, cfg.head_dim)] * 2
        assert r["draft_graphs"] == 1 and r["draft_collectives"] == 0
        assert r["draft_close"], "a draft compiled on a DCP group computes its unsharded self"
        assert r["draft_prefix_reads"] == 1, "the draft reads its whole cache up to each sequence's length"
        assert "did not go through a graph compiled by dcp.backend" in r["eager_error"]


@pytest.mark.parametrize("module_name", ["GptFastStyle", "IndexCopyStyle", "IndexPutBSHD", "HandWrittenGptFast",
                                         "HandWrittenHFEager"])
@pytest.mark.parametrize("size", [2, 3])
def test_write_idioms_shard_and_match_unsharded(module_name, size):
    results = spawn_ranks(idiom_worker, size, module_name)
    for r in results:
        for out, ref in zip(r["outs"], r["refs"]):
            torch.testing.assert_close(out, ref, **FP32_TOLERANCE)
    local = math.ceil(graphs.S / size) + 1
    if module_name in ("GptFastStyle", "HandWrittenGptFast"):
        assert results[0]["mask_buffers"] == ("causal_mask",)
        assert results[0]["buffers"]["causal_mask"] == (graphs.S, local)
    else:
        assert results[0]["mask_buffers"] == ()


def test_ranks_that_disagree_on_the_config_fail_at_prepare():
    messages = spawn_ranks(mismatch_worker, 2)
    for message in messages:
        assert message is not None and "ranks disagree on the target model config" in message
        assert "ranks [1] differ from rank 0" in message


def prepared_off_arm(cfg=LlamaConfig(), role="target"):
    group = dcp.init_group("cpu")
    model = make_model(cfg)
    dcp.prepare(model, group, role, max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
    return group, model


def test_compiling_a_target_that_was_never_prepared():
    group = dcp.init_group("cpu")
    model = make_model(LlamaConfig())
    compiled = torch.compile(model, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True)
    tokens = torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(Exception, match=r"dcp.prepare has not seen.*call dcp.prepare\(model, group, role='target'"):
        with torch.no_grad():
            compiled(tokens, tokens)


def test_model_without_kv_cache():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)

        def forward(self, tokens, positions):
            return self.emb(tokens) + positions[..., None]

    with pytest.raises(ValueError, match="has no KV cache: expected buffers written along a sequence axis"):
        dcp.prepare(Plain(), dcp.init_group("cpu"), "target", max_batch=2, max_seq_len=8)


def test_position_at_or_beyond_max_seq_len():
    cfg = LlamaConfig()
    group, model = prepared_off_arm(cfg)
    compiled = torch.compile(model, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True, dynamic=False)
    tokens = torch.zeros(cfg.max_batch, 1, dtype=torch.long)
    with torch.no_grad():
        compiled(tokens, torch.full_like(tokens, cfg.max_seq_len - 1))
        with pytest.raises(ValueError, match=r"positions must lie in \[0, max_seq_len=64\), got values in \[64, 64\]"):
            compiled(tokens, torch.full_like(tokens, cfg.max_seq_len))


@pytest.mark.gpu
def test_a_captured_call_asks_for_check_positions_off():
    """The positions check reads them on the host, which a CUDA-graph capture refuses:
    the capture gets the fix in words, before CUDA's own error, the device stays usable,
    and with the check off the same step captures and replays as it runs eagerly."""
    cfg = LlamaConfig()
    device = torch.device("cuda", 0)
    group = dcp.init_group(device)
    model = make_model(cfg).to(device)
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
    tokens = torch.ones(cfg.max_batch, 1, dtype=torch.long, device=device)
    positions = torch.zeros_like(tokens)
    compiled = {
        checked: torch.compile(model, backend=dcp.backend(group, check_positions=checked), fullgraph=True,
                               dynamic=False)
        for checked in (True, False)
    }
    with torch.no_grad():
        eager = compiled[True](tokens, positions).clone()  # compiles outside the capture
        with pytest.raises(RuntimeError, match=r"captured in a CUDA graph.*check_positions=False.*max_seq_len=64"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                compiled[True](tokens, positions)
        torch.testing.assert_close(compiled[True](tokens, positions), eager, rtol=0, atol=0)
        compiled[False](tokens, positions)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = compiled[False](tokens, positions)
        graph.replay()
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)


def test_group_larger_than_max_seq_len():
    group = dcp.DCPGroup(size=4, rank=0, device=torch.device("cpu"), process_group=None)
    cfg = LlamaConfig(max_seq_len=3)
    with pytest.raises(ValueError, match="DCP size 4 .* is larger than max_seq_len=3.*at most 3 ranks"):
        dcp.prepare(make_model(cfg), group, "target", max_batch=cfg.max_batch, max_seq_len=3)


def test_prepare_without_example_inputs_asks_for_them():
    module = graphs.NoCache()
    with pytest.raises(ValueError, match="Pass example_inputs="):
        dcp.prepare(module, dcp.init_group("cpu"), "target", max_batch=2, max_seq_len=16)


def test_cache_shape_must_match_prepare_arguments():
    cfg = LlamaConfig()
    with pytest.raises(ValueError, match=r"expected batch 3 and sequence 128"):
        dcp.prepare(make_model(cfg), dcp.init_group("cpu"), "target", max_batch=3, max_seq_len=128)


def test_cache_rows_other_than_max_batch_are_named_in_the_error():
    cfg = LlamaConfig(max_batch=4, gqa="enable_gqa")
    with pytest.raises(ValueError, match=r"forward with 2 rows \(max_batch=2\): if the model's KV caches hold another"):
        dcp.prepare(make_model(cfg), dcp.init_group("cpu"), "target", max_batch=2, max_seq_len=cfg.max_seq_len)


def test_role_must_match_between_prepare_and_backend():
    group, model = prepared_off_arm(role="draft")
    compiled = torch.compile(model, backend=dcp.backend(group, "target", lowering="aot_eager"), fullgraph=True)
    tokens = torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(Exception, match="prepared with role='draft' but is compiled with"):
        with torch.no_grad():
            compiled(tokens, tokens)


def test_prepare_twice_is_refused():
    group, model = prepared_off_arm()
    with pytest.raises(ValueError, match="already prepared"):
        dcp.prepare(model, group, "target", max_batch=3, max_seq_len=64)


@pytest.mark.parametrize("kwargs,message", [(dict(role="verify"), "role must be one of"), (dict(max_batch=0), "max_batch must be a positive int")])
def test_prepare_rejects_bad_arguments(kwargs, message):
    args = dict(role="target", max_batch=3, max_seq_len=64) | kwargs
    with pytest.raises(ValueError, match=message):
        dcp.prepare(make_model(LlamaConfig()), dcp.init_group("cpu"), args.pop("role"), **args)
