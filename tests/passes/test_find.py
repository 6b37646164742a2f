import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from dcp_compile.models import LlamaConfig
from dcp_compile.models.llama import GQA_FORMS
from dcp_compile.passes import GraphPatternError, find
from tests.support import capture_graph, make_model
from tests.passes import graphs


@pytest.mark.parametrize("gqa", GQA_FORMS)
def test_find_on_reference_model_finds_every_layer(gqa):
    cfg = LlamaConfig(n_layers=3, gqa=gqa)
    model = make_model(cfg)
    tokens = torch.zeros(cfg.max_batch, 1, dtype=torch.long)
    gm, inputs = capture_graph(model, tokens, tokens.clone())
    plan = find(gm)
    assert len(plan.sites) == cfg.n_layers
    assert len(plan.caches) == len(plan.writes) == 2 * cfg.n_layers
    for layer, site in enumerate(plan.sites):
        attention = model.layers[layer].attention
        assert inputs[site.k_write.cache.input_index] is attention.k_cache
        assert inputs[site.v_write.cache.input_index] is attention.v_cache
        assert site.k_write.index.kind == "setitem" and site.k_write.cache.seq_dim == 2
        assert site.scale == pytest.approx(cfg.head_dim**-0.5)
    assert [(inputs[i].dtype, reach) for i, reach in plan.position_inputs] == [(torch.long, 0)]
    assert plan.mask_inputs == ()


@pytest.mark.parametrize(
    "module_cls,kind,seq_dim",
    [(graphs.GptFastStyle, "setitem", 2), (graphs.IndexCopyStyle, "index_copy_", 2), (graphs.IndexPutBSHD, "index_put_", 1)],
)
def test_find_recognises_write_idioms(module_cls, kind, seq_dim):
    module = module_cls()
    gm, inputs = capture_graph(module, *graphs.inputs_for(module))
    plan = find(gm)
    assert len(plan.sites) == 1 and len(plan.writes) == 2
    assert {w.index.kind for w in plan.writes} == {kind}
    assert {c.seq_dim for c in plan.caches} == {seq_dim}
    site = plan.sites[0]
    assert {site.k_write.cache.node, site.v_write.cache.node} == {c.node for c in plan.caches}


def test_find_reports_mask_buffer_over_the_cache():
    module = graphs.GptFastStyle()
    gm, inputs = capture_graph(module, *graphs.inputs_for(module))
    plan = find(gm)
    assert [inputs[i] for i in plan.mask_inputs] == [module.causal_mask]


def test_find_leaves_attention_over_in_graph_tensors_alone():
    module = graphs.NoCache()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    before = gm.code
    plan = find(gm)
    assert plan.sites == () and plan.caches == () and plan.writes == ()
    assert gm.code == before


@pytest.mark.parametrize(
    "module_cls,marker,expected",
    [
        (graphs.CacheThenConcat, "UNCLASSIFIABLE-READ", "read by 'cat'"),
        (graphs.ScoresOverCache, "MATMUL-READ", "cannot shard"),
        # attention by hand that the passes cannot read
        (graphs.SoftmaxOverQueries, "WRONG-AXIS", "runs over axis 2, not over the keys"),
        (graphs.FilledWithoutInversion, "FILL", r"the passes read a fill as masked_fill\(~allowed, -inf\)"),
    ],
)
def test_unclassifiable_cache_read_names_the_source_line(module_cls, marker, expected):
    module = module_cls()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    with pytest.raises(GraphPatternError, match=expected) as error:
        find(gm)
    assert f"graphs.py:{graphs.line_of(marker)}" in str(error.value)


def test_batch_index_must_be_arange():
    class PermutedRows(graphs.IndexPutBSHD):
        def forward(self, x, positions):
            _, k, _ = self.project(x)
            rows = torch.tensor([1, 0])[:, None]
            self.k_cache.index_put_((rows, positions), k)
            return self.k_cache.sum()

    module = PermutedRows()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    with pytest.raises(GraphPatternError, match=r"expected torch.arange\(2\)"):
        find(gm)


class WriteIntoView(graphs.GptFastStyle):
    """Stores row 0's keys through ``k_cache[0]``, a view, not the cache buffer."""

    def forward(self, x, input_pos):
        _, k, _ = self.project(x)
        self.k_cache[0][:, input_pos] = k[0].transpose(0, 1)
        return self.k_cache.sum()


class TwoWrites(graphs.GptFastStyle):
    def forward(self, x, input_pos):
        q, k, _ = self.store(x, input_pos)
        self.k_cache[:, :, input_pos + 1] = k
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, enable_gqa=True)


class KeysAsValues(graphs.GptFastStyle):
    def forward(self, x, input_pos):
        q, _, _ = self.store(x, input_pos)
        return F.scaled_dot_product_attention(q, self.k_cache, self.k_cache, enable_gqa=True)


class KVAtTwoPositions(graphs.GptFastStyle):
    """Keys stored at the positions, values at the same positions in reverse order."""

    def forward(self, x, input_pos):
        q, k, v = self.project(x)
        self.k_cache[:, :, input_pos] = k.transpose(1, 2)
        self.v_cache[:, :, input_pos.flip(0)] = v.transpose(1, 2)
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, enable_gqa=True)


class Dropout(graphs.GptFastStyle):
    def forward(self, x, input_pos):
        q, _, _ = self.store(x, input_pos)
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, dropout_p=0.1, enable_gqa=True)


class FlexOverCache(graphs.GptFastStyle):
    def forward(self, x, input_pos):
        q, _, _ = self.store(x, input_pos)
        return flex_attention(q, self.k_cache, self.v_cache, enable_gqa=True)


class FirstHalfOfCache(graphs.GptFastStyle):
    """Attends to the cache's first half: a slice along the sequence, not a layout view."""

    def forward(self, x, input_pos):
        q, _, _ = self.store(x, input_pos)
        half = graphs.S // 2
        return F.scaled_dot_product_attention(q, self.k_cache[:, :, :half], self.v_cache[:, :, :half], enable_gqa=True)


REFUSED = [
    (WriteIntoView, r"writes into a view of graph input .*k_cache.*; expected KV writes into the cache buffer itself"),
    (TwoWrites, r"k_cache.* is written 2 times in one graph .*expected one write per cache per forward"),
    (KeysAsValues, r"reads one cache \(.*k_cache.*\) as both keys and values"),
    (KVAtTwoPositions, r"reads caches written at different position tensors"),
    (Dropout, r"uses dropout; dcp-compile compiles inference graphs"),
    (FlexOverCache, r"flex_attention over a KV cache .* is not supported yet"),
    (FirstHalfOfCache, r"reads KV cache .*k_cache.* through 'getitem' .*, a view the passes do not understand"),
]


@pytest.mark.parametrize("module_cls,expected", REFUSED, ids=[cls.__name__ for cls, _ in REFUSED])
def test_find_refuses_what_it_cannot_shard(module_cls, expected):
    module = module_cls()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    with pytest.raises(GraphPatternError, match=expected) as error:
        find(gm)
    assert "test_find.py:" in str(error.value), "the error names the user's line"


def test_a_write_into_a_tensor_made_in_the_graph_is_no_cache():
    class Scratch(graphs.GptFastStyle):
        def forward(self, x, input_pos):
            _, k, _ = self.project(x)
            scratch = torch.zeros(graphs.B, graphs.HKV, graphs.S, graphs.D)
            scratch[0][:, input_pos] = k[0].transpose(0, 1)
            return scratch.sum()

    module = Scratch()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    plan = find(gm)
    assert plan.caches == () and plan.writes == () and plan.sites == ()


def test_the_source_line_skips_torch_frames_but_not_files_in_an_environment_named_torch():
    """A stack trace from a virtual environment under ``/opt/torch/.venv``: transformers'
    line is the user's, torch's own wrapper is not."""
    import os

    from dcp_compile.passes.fx_utils import source_line

    torch_dir = os.path.dirname(torch.__file__)
    trace = "\n".join([
        '  File "/srv/app/serve.py", line 12, in step',
        "    logits = model(input_ids)",
        '  File "/opt/torch/.venv/lib/python3.12/site-packages/transformers/masking_utils.py", line 140, in sliding',
        "    return kv_idx > q_idx - sliding_window",
        f'  File "{torch_dir}/nn/functional.py", line 5000, in pad',
        "    return torch._C._nn.pad(input, pad)",
    ])
    node = torch.fx.Graph().placeholder("mask")
    node.meta["stack_trace"] = trace
    assert source_line(node) == (
        "/opt/torch/.venv/lib/python3.12/site-packages/transformers/masking_utils.py:140: "
        "return kv_idx > q_idx - sliding_window"
    )
    node.meta["stack_trace"] = "\n".join(trace.splitlines()[-2:])
    assert source_line(node).startswith(f"{torch_dir}/nn/functional.py:5000"), "only torch frames: the innermost"
