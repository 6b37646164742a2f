import pytest
import torch

from dcp_compile.models import DraftConfig, EagleDraft, LlamaConfig, eagle3_aux_layers
from dcp_compile.models.llama import init_weights
from dcp_compile.runtime.launch import spawn_ranks
from tests.support import FP32_TOLERANCE, make_model
from tests.runtime.workers import draft_and_aux_worker


def test_eagle3_reads_layers_2_half_and_minus_3():
    assert eagle3_aux_layers(32) == (2, 16, 29)
    assert eagle3_aux_layers(8) == (2, 4, 5)


@pytest.mark.parametrize("n_layers", range(1, 12))
def test_eagle3_reads_three_distinct_layers_of_any_target_deep_enough(n_layers):
    layers = eagle3_aux_layers(n_layers)
    assert len(layers) == min(3, n_layers) and len(set(layers)) == len(layers)
    assert all(0 <= i < n_layers for i in layers)


@pytest.mark.parametrize("n_layers", [2, 4, 5, 6])
def test_the_draft_follows_the_targets_feature_count(n_layers):
    cfg = LlamaConfig(n_layers=n_layers, aux_layers=eagle3_aux_layers(n_layers))
    draft = EagleDraft(DraftConfig(cfg, "eagle3"))
    assert draft.fc.in_features == len(cfg.aux_layers) * cfg.dim
    target = make_model(cfg)
    B = cfg.max_batch
    tokens = torch.randint(0, cfg.vocab_size, (B, 3), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(3).expand(B, 3)
    with torch.no_grad():
        _, features = target(tokens, positions)
        logits, hidden = draft(tokens, positions, features)
    assert logits.shape == (B, 3, cfg.vocab_size) and hidden.shape == (B, 3, cfg.dim)


def test_a_draft_feature_count_that_differs_from_the_target_is_refused():
    cfg = LlamaConfig(n_layers=4, aux_layers=(0, 1, 2))
    with pytest.raises(ValueError, match=r"n_features=2 target hidden states but the target returns 3"):
        DraftConfig(cfg, "eagle3", n_features=2)
    with pytest.raises(ValueError, match="needs at least 2 target features, got 1"):
        DraftConfig(LlamaConfig(n_layers=4, aux_layers=(2,)), "eagle3")


def test_aux_hidden_states_are_the_inputs_of_the_chosen_layers():
    cfg = LlamaConfig(n_layers=4, aux_layers=(1, 3, 4))
    model = make_model(cfg)
    seen = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0]))
    model.norm.register_forward_hook(lambda m, args, out: seen.__setitem__("final", out))
    tokens = torch.randint(0, cfg.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5).expand(3, 5)
    with torch.no_grad():
        logits, hidden = model(tokens, positions)
    assert torch.equal(hidden, torch.cat([seen[1], seen[3], seen["final"]], dim=-1))
    assert logits.shape == (3, 5, cfg.vocab_size)


def test_aux_layers_are_validated():
    with pytest.raises(ValueError, match="aux_layers must be increasing layer indices in \\[0, n_layers=2\\]"):
        LlamaConfig(n_layers=2, aux_layers=(3,))


def test_eagle3_draft_maps_its_vocabulary_to_target_ids():
    cfg = DraftConfig(LlamaConfig(), "eagle3", draft_vocab_size=16)
    draft = init_weights(EagleDraft(cfg), 1)
    draft.d2t.copy_(torch.arange(16) * 5)  # draft id i is target id 6 i
    assert draft.to_target_ids(torch.tensor([0, 1, 15])).tolist() == [0, 6, 90]
    with pytest.raises(ValueError, match="reduced draft vocabulary is an EAGLE3 feature"):
        DraftConfig(LlamaConfig(), "eagle", draft_vocab_size=16)


def test_eagle_shares_embedding_and_head_with_the_target():
    cfg = LlamaConfig()
    target = make_model(cfg)
    draft = EagleDraft(DraftConfig(cfg, "eagle")).share_target_weights(target)
    assert draft.embed.weight is target.tok_embeddings.weight and draft.head.weight is target.output.weight


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_draft_stays_whole_beside_a_sharded_target(kind):
    for r in spawn_ranks(draft_and_aux_worker, 2, kind):
        for got, expected in r["pairs"]:
            torch.testing.assert_close(got, expected, **FP32_TOLERANCE)
        assert r["draft_collectives"] == [0, 0], "draft extend and draft step graphs hold no collective"
        assert r["target_collectives"] == [8], "one all-gather + wait per target layer"
        assert r["draft_cache"] == (3, 2, 64, 16), "the draft's cache stays whole"
        if kind == "eagle3":
            assert r["hidden_width"] == 3 * 64 and r["draft_vocab"] == 64
            assert r["target_ids"].tolist() == (torch.arange(64) * 3 % 256).tolist()
