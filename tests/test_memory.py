"""Memory planning and KV caches built on the meta device."""

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.memory import GiB, CapacityError, MemoryPlanner, kv_slots, plan_memory, pool_plan
from dcp_compile.models import DraftConfig, LlamaConfig
from dcp_compile.runtime.launch import spawn_ranks
from tests.support import make_model, parity_worker
from tests.runtime.test_parity import STEPS, assert_parity

LLAMA_8B = LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                       max_seq_len=64, aux_layers=(2, 16, 29))
H200_BYTES = 143771 << 20


def test_kv_bytes_follow_the_layout():
    cfg = LlamaConfig(n_layers=3, n_kv_heads=2, dim=64, n_heads=4)  # head_dim 16
    planner = MemoryPlanner(cfg, budget_bytes=1 << 40, dtype=torch.bfloat16, verify_tokens=5, interleave=2)
    per_slot = 3 * 2 * 2 * 16 * 2
    assert planner.plan(1, 4, 1000).target_kv_bytes == per_slot * 4 * 1000
    # S_loc = ceil(1000 / (2 * 3)) * 2 = 334, then the trash slot and 5 staging slots
    assert kv_slots(1000, 3, 2, 5) == 340
    assert planner.plan(3, 4, 1000).target_kv_bytes == per_slot * 4 * 340


def test_a_tree_target_keeps_its_trash_and_staging_slots_on_a_group_of_one():
    cfg = LlamaConfig(n_layers=3, n_kv_heads=2, dim=64, n_heads=4)  # head_dim 16
    per_slot = 3 * 2 * 2 * 16 * 2
    # a chain of 4 verifies in place on a group of one; a tree of 6 nodes stages its root
    # and nodes (7 slots) after the trash slot, on any group
    assert kv_slots(1000, 1, verify_tokens=5) == 1000
    assert kv_slots(1000, 1, verify_tokens=7, tree=True) == 1000 + 1 + 7
    assert kv_slots(1000, 3, 2, 7, tree=True) == kv_slots(1000, 3, 2, 7) == 334 + 1 + 7
    tree = MemoryPlanner(cfg, budget_bytes=1 << 40, dtype=torch.bfloat16, verify_tokens=7, tree=True)
    assert tree.plan(1, 4, 1000).target_kv_bytes == per_slot * 4 * 1008
    assert plan_memory(cfg, dcp_size=1, max_batch=4, max_seq_len=1000, budget_bytes=1 << 40, verify_tokens=7,
                       tree=True).target_kv_bytes == per_slot * 4 * 1008
    # and prepare lays a tree target's caches out so
    small = LlamaConfig()
    model = make_model(small, cache_device="meta")
    dcp.prepare(model, dcp.init_group("cpu"), max_batch=small.max_batch, max_seq_len=small.max_seq_len,
                verify_tokens=7, tree=True)
    assert model.layers[0].attention.k_cache.shape[2] == kv_slots(small.max_seq_len, 1, verify_tokens=7, tree=True)


def test_a_tree_drafts_cache_counts_its_tree_slots_as_prepare_allocates_them():
    from dcp_compile.models import EagleDraft

    cfg = LlamaConfig(max_batch=2, max_seq_len=40)
    draft_cfg = DraftConfig(cfg, "eagle3")
    chain, tree = (MemoryPlanner(cfg, 1 << 40, torch.float32, draft_cfg, 5, tree=t, draft_tree_slots=slots)
                   for t, slots in ((False, 0), (True, 3 * 4)))
    per_row_slot = 2 * cfg.n_kv_heads * cfg.head_dim * 4  # keys and values, fp32
    grown = tree.plan(1, 2, 40).draft_bytes - chain.plan(1, 2, 40).draft_bytes
    assert grown == per_row_slot * 2 * 12
    draft = EagleDraft(draft_cfg, cache_device="meta")
    example = (torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, 3 * cfg.dim))
    dcp.prepare(draft, dcp.init_group("cpu"), "draft", max_batch=2, max_seq_len=40, example_inputs=example, tree_slots=12)
    assert draft.attention.k_cache.shape[2] == 40 + 12


def test_weights_are_counted_from_the_model_itself():
    cfg = LlamaConfig()
    model = make_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert MemoryPlanner(cfg, 1 << 40, dtype=torch.float32).plan(1, 1, 64).weight_bytes == params * 4


def test_8b_shapes_on_one_h200():
    planner = MemoryPlanner(LLAMA_8B, H200_BYTES, draft=DraftConfig(LLAMA_8B, "eagle3"), verify_tokens=4)
    assert 14.5 * GiB < planner.plan(1, 1, 1024).weight_bytes < 15.5 * GiB
    assert planner.plan(1, 8, 65536).fits
    assert not planner.plan(1, 8, 131072).fits and planner.plan(2, 8, 131072).fits
    assert planner.smallest_dcp_size(8, 131072) == 2
    for dcp_size in (1, 2):
        longest = planner.longest_context(dcp_size, 8)
        assert planner.plan(dcp_size, 8, longest).fits and not planner.plan(dcp_size, 8, longest + 1).fits
        batch = planner.largest_batch(dcp_size, 131072)
        assert batch == 0 or planner.plan(dcp_size, batch, 131072).fits
        assert not planner.plan(dcp_size, batch + 1, 131072).fits
    # DCP=2 holds about twice the context of DCP=1 at the same batch
    assert 1.8 < planner.longest_context(2, 8) / planner.longest_context(1, 8) < 2.2


def test_refusal_gives_the_numbers_and_what_fits():
    planner = MemoryPlanner(LLAMA_8B, H200_BYTES)
    with pytest.raises(CapacityError, match=r"target KV 128\.0 GiB .* budget 140\.4 GiB\. What fits: a DCP group of 2 "
                                            r"ranks; max_batch=7 at this context; max_seq_len=\d+ at this batch"):
        planner.check(1, 8, 131072)
    with pytest.raises(CapacityError, match="even the weights do not fit"):
        MemoryPlanner(LLAMA_8B, 10 * GiB).check(1, 1, 1024)


def test_plan_memory_needs_a_budget():
    with pytest.raises(ValueError, match="needs device= .* or budget_bytes="):
        plan_memory(LLAMA_8B, dcp_size=1, max_batch=1, max_seq_len=1024)
    with pytest.raises(ValueError, match="no memory budget is known for device cpu"):
        plan_memory(LLAMA_8B, dcp_size=1, max_batch=1, max_seq_len=1024, device="cpu")
    assert plan_memory(LLAMA_8B, dcp_size=2, max_batch=1, max_seq_len=1024, budget_bytes=H200_BYTES).fits


def test_meta_caches_are_allocated_by_prepare_at_full_size_for_a_group_of_one():
    cfg = LlamaConfig()
    model = make_model(cfg, cache_device="meta")
    assert model.layers[0].attention.k_cache.is_meta
    prepared = dcp.prepare(model, dcp.init_group("cpu"), max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
    cache = model.layers[0].attention.k_cache
    assert cache.device.type == "cpu" and cache.shape == (cfg.max_batch, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim)
    assert not cache.any() and prepared.kv_bytes == 2 * cfg.n_layers * cache.numel() * 4
    assert all(not p.is_meta for p in model.parameters()), "the trace must give the weights back"
    assert not model.rope_cos.is_meta


def test_meta_caches_sharded_over_two_ranks_decode_like_the_unsharded_model():
    results = spawn_ranks(parity_worker, 2, "aot_eager", "enable_gqa", STEPS, 1, "ag", "meta", timeout=600)
    assert_parity(results, 2)


def test_a_model_all_on_meta_is_refused():
    with torch.device("meta"):
        model = make_model(LlamaConfig(), device="meta", cache_device="meta")
    with pytest.raises(ValueError, match="no parameters off the meta device; load its weights before prepare"):
        dcp.prepare(model, dcp.init_group("cpu"), max_batch=3, max_seq_len=64)


def test_plan_command_prints_what_the_planner_says(capsys):
    from dcp_compile.cli import main
    from dcp_compile.models.llama import llama3_8b_shape

    assert main(["plan", "--gpu-gib", "139.8", "--dcp", "1,2", "--batches", "8", "--contexts", "131072"]) == 0
    printed = capsys.readouterr().out
    cfg = llama3_8b_shape()
    planner = MemoryPlanner(cfg, int(139.8 * GiB), draft=DraftConfig(cfg, "eagle3"), verify_tokens=4)
    longest = [planner.longest_context(n, 8) for n in (1, 2)]
    widest = [planner.largest_batch(n, 131072) for n in (1, 2)]
    assert f"| 8 | {longest[0]:,} | {longest[1]:,} |" in printed
    assert f"| 131,072 | {widest[0]:,} | {widest[1]:,} |" in printed
    assert widest[1] >= 2 * widest[0] - 1 and longest[1] > longest[0]


def test_plan_command_sizes_a_tree_by_its_verify_width(capsys):
    from dcp_compile.cli import main
    from dcp_compile.models.llama import llama3_8b_shape

    assert main(["plan", "--gpu-gib", "139.8", "--dcp", "1,2", "--batches", "8", "--contexts", "131072",
                 "--k", "4", "--topk", "2", "--draft-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    cfg = llama3_8b_shape()
    planner = MemoryPlanner(cfg, int(139.8 * GiB), draft=DraftConfig(cfg, "eagle3"), verify_tokens=7, tree=True)
    assert "EAGLE3 draft, tree k=4 topk=2 draft_tokens=6" in printed
    assert f"| 8 | {planner.longest_context(1, 8):,} | {planner.longest_context(2, 8):,} |" in printed


def _planner(draft: bool, **options) -> MemoryPlanner:
    from dcp_compile.models.llama import llama3_8b_shape

    cfg = llama3_8b_shape()
    return MemoryPlanner(cfg, int(139.8 * GiB), draft=DraftConfig(cfg, "eagle3") if draft else None,
                         verify_tokens=4 if draft else 0, **options)


@pytest.mark.parametrize("dcp_size", [1, 2, 8])
def test_a_pool_is_the_most_whole_pages_that_fit_beside_the_weights_and_rows(dcp_size):
    planner = _planner(draft=True)
    pool = pool_plan(planner, dcp_size, max_batch=16, page_size=16, fraction=0.9)
    assert pool.kv_tokens % (16 * dcp_size) == 0 and pool.rank_tokens * dcp_size == pool.kv_tokens
    assert pool.total_bytes <= pool.budget_bytes == int(139.8 * GiB * 0.9)
    # one more page a rank: its target slots here, and the draft's slots for all D pages of the group
    per_page = (pool.target_pool_bytes + pool.draft_pool_bytes) // (pool.rank_tokens // 16)
    assert pool.total_bytes + per_page > pool.budget_bytes
    # on the whole device the pool holds at least what static rows of 128K do, in any mix of requests
    static_rows = planner.largest_batch(dcp_size, 131072)
    assert pool_plan(planner, dcp_size, 16, 16, fraction=1.0).kv_tokens >= static_rows * 131072 > 0


def test_the_drafts_pages_are_charged_whole_on_every_rank():
    """Without a draft a rank's share of the pool barely moves with D; with one, every
    rank pays the draft's pages for all N tokens, so its share shrinks as D grows."""
    plain = [pool_plan(_planner(draft=False), n, 8, 16).rank_tokens for n in (1, 2, 8)]
    drafted = [pool_plan(_planner(draft=True), n, 8, 16) for n in (1, 2, 8)]
    assert max(plain) - min(plain) <= 16 * 2  # the trash slot of a sharded row, rounded to pages
    assert drafted[0].rank_tokens > drafted[1].rank_tokens > drafted[2].rank_tokens
    for pool in drafted:
        assert pool.draft_pool_bytes == pool.kv_tokens * 2 * 8 * 128 * 2  # the draft layer: 8 KV heads x 128, bf16


@pytest.mark.parametrize("page_size, options, message", [
    (0, {}, "page_size must be a positive int, got 0"),
    (6, {"interleave": 4}, "page_size 6 is not a multiple of the layout's interleave 4"),
])
def test_a_page_that_does_not_hold_whole_blocks_is_refused(page_size, options, message):
    with pytest.raises(ValueError, match=message):
        pool_plan(_planner(draft=False, **options), 2, 8, page_size)


def test_plan_command_prints_the_pool(capsys):
    from dcp_compile.cli import main

    assert main(["plan", "--gpu-gib", "139.8", "--dcp", "1,2", "--batches", "8", "--contexts", "131072",
                 "--page-size", "16", "--gpu-memory-utilization", "0.8"]) == 0
    printed = capsys.readouterr().out
    pools = [pool_plan(_planner(draft=True), n, 8, 16, 0.8).kv_tokens for n in (1, 2)]
    assert "pages of 16 slots a rank, 0.80 of the memory" in printed
    assert f"| 8 | {pools[0]:,} | {pools[1]:,} |" in printed


@pytest.mark.parametrize("argv,message", [
    (["--page-size", "0"], "plan --page-size 0: page_size must be a positive int, got 0"),
    (["--page-size", "16", "--gpu-memory-utilization", "1.5"], "the memory fraction must be in (0, 1], got 1.5"),
    (["--dcp", "0"], "--dcp takes comma-separated positive integers, got '0'"),
    (["--batches", "8,x"], "--batches takes comma-separated positive integers"),
    (["--gpu-gib", "-1"], "--gpu-gib must be > 0"),
    (["--k", "-1"], "--k must be >= 0"),
    (["--k", "0", "--topk", "2"], "--topk given with --k 0: a draft tree needs a draft, and --k 0 asks for none"),
    (["--k", "0", "--draft-tokens", "4"], "--draft-tokens given with --k 0"),
    (["--model", "deepseek-v2-lite", "--topk", "2"], "attends through MLA's latent cache, which takes no tree mask"),
])
def test_plan_command_bad_flags(capsys, argv, message):
    from dcp_compile.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--gpu-gib", "80", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_plan_command_without_a_gpu_asks_for_the_memory(capsys, monkeypatch):
    from dcp_compile.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main(["plan"])
    assert "pass --gpu-gib" in capsys.readouterr().err


def test_a_draft_cache_left_on_meta_is_allocated_whole():
    cfg = LlamaConfig(aux_layers=(0, 1, 2))
    from dcp_compile.models import EagleDraft

    draft = EagleDraft(DraftConfig(cfg, "eagle3"), cache_device="meta").eval()
    assert draft.attention.k_cache.is_meta
    feature_width = cfg.dim * 3
    example = (torch.zeros(cfg.max_batch, 1, dtype=torch.long), torch.zeros(cfg.max_batch, 1, dtype=torch.long),
               torch.zeros(cfg.max_batch, 1, feature_width))
    dcp.prepare(draft, dcp.init_group("cpu"), "draft", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len,
                example_inputs=example)
    cache = draft.attention.k_cache
    assert not cache.is_meta and cache.shape == (cfg.max_batch, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim)
    assert not cache.any()


def test_mla_cache_is_one_latent_and_rope_key_per_token_and_layer():
    from dcp_compile.models.mla import MLATransformer, deepseek_v2_lite_shape, deepseek_v3_attention_shape

    # DeepSeek-V2-Lite: 27 layers x (512 + 64) numbers x 2 bytes = 31,104 bytes per token, no heads
    lite = MemoryPlanner(deepseek_v2_lite_shape(), budget_bytes=H200_BYTES, dtype=torch.bfloat16, verify_tokens=4)
    assert lite.plan(1, 8, 32768).target_kv_bytes == 27 * 576 * 2 * 8 * 32768
    # DCP=2: ceil(32768 / 2) owner slots, a trash slot and 4 staging slots per sequence and rank
    assert lite.plan(2, 8, 32768).target_kv_bytes == 27 * 576 * 2 * 8 * (16384 + 1 + 4)
    v3 = MemoryPlanner(deepseek_v3_attention_shape(), budget_bytes=H200_BYTES, dtype=torch.bfloat16)
    assert v3.plan(8, 1, 131072).target_kv_bytes == 61 * 576 * 2 * (16384 + 1)
    # weights come from the reference model itself, built on the meta device
    small = deepseek_v2_lite_shape(n_layers=1, vocab_size=1000)
    with torch.device("meta"):
        params = sum(p.numel() for p in MLATransformer(small).parameters())
    assert MemoryPlanner(small, 1 << 40).plan(1, 1, 64).weight_bytes == params * 2
    # an EAGLE3 draft for it is a Llama layer of the target's width and heads, its cache whole
    from dcp_compile.models.mla import draft_config

    drafted = deepseek_v2_lite_shape(aux_layers=(2, 13, 24))
    with_draft = MemoryPlanner(drafted, H200_BYTES, draft=draft_config(drafted), verify_tokens=4).plan(2, 8, 32768)
    without = MemoryPlanner(drafted, H200_BYTES, verify_tokens=4).plan(2, 8, 32768)
    assert with_draft.target_kv_bytes == without.target_kv_bytes
    from dcp_compile.models import EagleDraft

    with torch.device("meta"):
        draft = EagleDraft(draft_config(drafted))
    weights = sum(p.numel() for name, p in draft.named_parameters() if not name.startswith("embed.")) * 2
    # its cache: keys and values of 16 heads x 128 per token, 8 x 32768 tokens, bf16, whole on every rank
    assert with_draft.draft_bytes == weights + 2 * 16 * 128 * 2 * 8 * 32768


def test_plan_command_knows_the_mla_cache(capsys):
    from dcp_compile.cli import main
    from dcp_compile.models.mla import deepseek_v2_lite_shape, draft_config

    assert main(["plan", "--model", "deepseek-v2-lite", "--gpu-gib", "139.8", "--dcp", "1,2", "--batches", "8",
                 "--contexts", "131072"]) == 0
    out = capsys.readouterr().out
    assert "latent cache 512 + rope key 64 per token and layer" in out and "EAGLE3 draft, k=3" in out
    cfg = deepseek_v2_lite_shape(aux_layers=(2, 13, 24))
    planner = MemoryPlanner(cfg, int(139.8 * GiB), draft=draft_config(cfg), verify_tokens=4)
    longest = planner.longest_context(2, 8)
    assert f"| 8 | {planner.longest_context(1, 8):,} | {longest:,} |" in out
