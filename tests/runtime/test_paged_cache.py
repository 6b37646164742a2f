"""A target's caches paged by the compiler (``prepare(page_size=P, kv_tokens=N)``) on a
group of one: the write idioms against themselves unpaged, the engine admitting requests
by the pages they need (against unpaged rows, bitwise), and the refusals.  The DCP arms
run paged in the chain and tree gates (``test_spec_gate``, ``test_tree_spec``)."""

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.passes import GraphPatternError
from dcp_compile.records import record_for
from dcp_compile.runtime.engine import RequestOutput, SamplingParams, SpecEngine
from tests.passes import graphs
from tests.runtime.test_engine import PROMPTS, run
from tests.support import FP32_TOLERANCE, agreeing_pair

PAGED_IDIOMS = ["GptFastStyle", "IndexCopyStyle", "HandWrittenGptFast", "HandWrittenHFEager"]


def shuffled_pages(paging, seed=3):
    """Every row's every page, from a shuffled pool: reads in page order would be wrong."""
    table = paging.table
    pages = torch.randperm(paging.shape.pages, generator=torch.Generator().manual_seed(seed))[: table.numel()]
    table.copy_(pages.view(table.shape).to(table.dtype))


@pytest.mark.parametrize("module_name", PAGED_IDIOMS)
def test_write_idioms_paged_match_the_unpaged_module(module_name):
    group = dcp.init_group("cpu")
    module_cls = getattr(graphs, module_name)
    torch.manual_seed(0)
    model, reference = module_cls(), module_cls()
    reference.load_state_dict(model.state_dict())
    prepared = dcp.prepare(model, group, "target", max_batch=graphs.B, max_seq_len=graphs.S, page_size=4,
                           kv_tokens=2 * graphs.B * graphs.S, example_inputs=graphs.inputs_for(model, 1))
    shuffled_pages(prepared.paging)
    cache = next(b for _, b in model.named_buffers() if record_for(b) is not None)
    assert cache.stride(2) == 0, "the model's buffer is a stand-in with no memory along the sequence"
    compiled = torch.compile(model, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for start, tokens in [(0, 5)] + [(p, 1) for p in range(5, 12)]:
            x, pos = torch.randn(graphs.B, tokens, graphs.D, generator=gen), torch.arange(start, start + tokens)
            torch.testing.assert_close(compiled(x, pos), reference(x, pos), **FP32_TOLERANCE)
    with pytest.raises(RuntimeError, match="did not go through a graph compiled by dcp.backend"):
        model(x, pos)  # a paged model has no cache of its own to run on


def make_decoder(**paging):
    target, draft = agreeing_pair("eagle3", noise=3.0, max_batch=3)
    return dcp.SpecDecoder(target, draft, dcp.init_group("cpu"), k=3, max_batch=3, max_seq_len=96,
                           lowering="aot_eager", **paging)


@pytest.fixture(scope="module")
def decoders():
    """Rows of 96 slots, and a pool of 72 tokens (pages of 8) for the same three rows."""
    return make_decoder(), make_decoder(page_size=8, kv_tokens=72)


def test_requests_wait_for_pages_and_give_the_unpaged_tokens(decoders):
    static, paged = decoders
    lengths = [40, 5, 30, 9, 14, 7]
    seeds = [None, 7, None, 8, None, 9]  # greedy and seeded rows
    arrivals = [(at, p, SamplingParams(max_new_tokens=n, temperature=0.0 if s is None else 0.8, seed=s))
                for at, p, n, s in zip([0, 0, 0, 3, 3, 9], PROMPTS, lengths, seeds)]
    engine = SpecEngine(paged)
    waited = []
    engine_step = engine.step
    engine.step = lambda: (waited.append((engine.running, len(engine.waiting))), engine_step())[1]
    expected, out = run(SpecEngine(static), arrivals, aborts=[(4, 4)]), run(engine, arrivals, aborts=[(4, 4)])
    assert out["tokens"] == expected["tokens"] and out["accepted"] == expected["accepted"]
    assert out["ends"] == expected["ends"] == ["length"] * 4 + ["aborted", "length"]
    assert any(running < 3 and queued for running, queued in waited), "the pool, not the rows, held requests back"
    assert engine.pages.used_tokens == 0 and (engine.pages.blocks.table == engine.pages.blocks.null_page).all()


def test_rows_grow_a_page_at_a_time_and_the_newest_request_is_preempted(decoders):
    """With preemption, three requests of 30 new tokens start in a pool of 9 pages that holds
    two of them whole: as they grow, the newest is preempted and computed again later, from
    its prompt and the tokens it had emitted; a preempted request whose client leaves ends."""
    static, paged = decoders
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0]]
    arrivals = [(0, p, SamplingParams(max_new_tokens=30)) for p in prompts]
    expected = run(SpecEngine(static), arrivals)
    engine = SpecEngine(paged, preemption=True)
    out = run(engine, arrivals)
    assert out["tokens"] == expected["tokens"] and out["ends"] == ["length"] * 4
    assert engine.stats["preemptions"] > 0 and engine.pages.used_tokens == 0
    engine = SpecEngine(paged, preemption=True)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=30)) for p in prompts[:3]]
    ends, preempted = {}, None
    while engine.has_work():
        ends.update({i: e.finished_by for i, e in engine.step().items() if e.finished_by})
        if preempted is None and engine.stats["preemptions"]:
            preempted = next(r.id for r in engine.waiting if r.resumed)
            assert engine.abort(preempted)
    assert sorted(ends) == ids and ends[preempted] == "aborted" and list(ends.values()).count("length") == 2
    with pytest.raises(ValueError, match="preemption grows a paged target's rows"):
        SpecEngine(static, preemption=True)


def test_a_request_larger_than_the_pool_is_refused_with_both_numbers(decoders):
    engine = SpecEngine(decoders[1])
    with pytest.raises(ValueError, match=r"needs 74 tokens of KV, more than the whole pool's 72"):
        engine.add_request([1] * 30, SamplingParams(max_new_tokens=40))
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4))
    out = {}
    while engine.has_work():
        out.update(engine.step())
    assert out[rid].finished_by == "length"
    refused, served = dcp.generate_all(decoders[1], [[1] * 30, PROMPTS[1]], 40)
    assert refused.finished_by == "refused" and "more than the whole pool's 72" in refused.error
    assert served.finished_by == "length" and len(served.tokens) == 40


SYSTEM = [(7 * i + 3) % 29 + 1 for i in range(20)]  # a shared "system prompt": two whole pages of 8 and 4 tokens
OTHER = [(3 * i + 1) % 31 for i in range(24)]


def serve_in_turn(engine, prompts, max_new=12):
    """Each prompt after the one before it has finished: its tokens, accept counts and cached tokens."""
    outputs = []
    for prompt in prompts:
        rid, out = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new)), RequestOutput()
        while engine.has_work():
            event = engine.step().get(rid)
            if event is not None:
                out.tokens += event.tokens
                out.accepted += event.accepted
                out.cached_tokens = out.cached_tokens if event.cached_tokens is None else event.cached_tokens
        outputs.append((out.tokens, out.accepted, out.cached_tokens))
    return outputs


@pytest.fixture(scope="module", params=["chain", "tree"])
def chunked(request):
    """Pages of 8 and prefill chunks of 8, so that a hit may end on any page; a pool of 96
    tokens; a chain of 3 drafts, or a tree of 6 nodes, 3 deep (the draft's tree slots past its rows)."""
    tree = dict(topk=2, draft_tokens=6) if request.param == "tree" else {}
    return make_decoder(page_size=8, kv_tokens=96, chunk_size=8, **tree)


def test_a_prefix_hit_gives_the_tokens_and_accept_counts_of_a_miss(chunked):
    # The second prompt shares nothing, and overwrites the row's draft cache the first left.
    prompts = [SYSTEM + [30, 31, 2], OTHER, SYSTEM + [5], SYSTEM[:16] + [0, 9, 9], SYSTEM[:8] + [1, 2]]
    engine = SpecEngine(chunked)
    hit, miss = serve_in_turn(engine, prompts), serve_in_turn(SpecEngine(chunked, prefix_caching=False), prompts)
    assert [tokens for tokens, _, _ in hit] == [tokens for tokens, _, _ in miss]
    assert [accepted for _, accepted, _ in hit] == [accepted for _, accepted, _ in miss], \
        "the draft's keys of the reused pages are the ones a miss computes"
    # The third prompt reuses both pages its 17th token follows; the fourth's 17th token
    # differs from the one the cached second page's draft keys read, so only the first page is
    # reused; the fifth's token after the first page differs too.
    assert [cached for _, _, cached in hit] == [0, 0, 16, 8, 0]
    assert [cached for _, _, cached in miss] == [0] * 5 and engine.stats["prefix_hit_tokens"] == 24
    assert engine.pages.used_tokens == 0, "cached pages no request holds count as free"


def test_cached_pages_are_evicted_under_pressure_and_recomputed(chunked):
    long = [(5 * i) % 29 + 2 for i in range(70)]  # with its 12 new tokens and window: 11 of the 12 pages
    prompts = [SYSTEM + [30], long, SYSTEM + [30, 31]]
    engine = SpecEngine(chunked)
    pressed, fresh = serve_in_turn(engine, prompts), serve_in_turn(SpecEngine(chunked, prefix_caching=False), prompts)
    assert [cached for _, _, cached in pressed] == [0, 0, 0], "the long prompt took the system prompt's first page"
    assert [out[:2] for out in pressed] == [out[:2] for out in fresh]
    assert serve_in_turn(engine, [SYSTEM + [30, 31]])[0][2] == 16, "served again, it is cached again"


def test_paged_memory_is_the_pool_not_the_rows():
    page, pool_tokens = 8, 96
    static, _ = agreeing_pair("eagle3", noise=3.0, max_batch=3)
    paged, _ = agreeing_pair("eagle3", noise=3.0, max_batch=3)
    group = dcp.init_group("cpu")
    rows = dcp.prepare(static, group, "target", max_batch=3, max_seq_len=96, verify_tokens=4, tree=True)
    pool = dcp.prepare(paged, group, "target", max_batch=3, max_seq_len=96, verify_tokens=4, page_size=page,
                       kv_tokens=pool_tokens)
    assert pool.paging.shape.pages == pool_tokens // page and pool.paging.table.shape == (3, 96 // page)
    # Rows: 3 x (96 + 1 + 4) slots a cache; the pool: 13 pages of 8, and 3 x 5 trash and staging slots.
    assert pool.kv_bytes / rows.kv_bytes == pytest.approx((13 * 8 + 3 * 5) / (3 * 101))


@pytest.mark.parametrize("options, message", [
    (dict(page_size=3, interleave=2, kv_tokens=96), "does not divide into the layout's blocks of interleave=2"),
    (dict(page_size=8, kv_tokens=4), "kv_tokens=4 is less than one page of 8 tokens"),
    (dict(page_size=-1, kv_tokens=96), "page_size must be a positive int"),
    (dict(page_size=8), "page_size without kv_tokens sizes the pool from a CUDA device's free memory; the model is on "
                        "cpu. Give kv_tokens="),
])
def test_bad_pools_are_refused(options, message):
    target, _ = agreeing_pair("eagle3", noise=3.0, max_batch=3)
    with pytest.raises(ValueError, match=message):
        dcp.prepare(target, dcp.init_group("cpu"), "target", max_batch=3, max_seq_len=96, **options)


@pytest.mark.gpu
def test_page_size_alone_sizes_the_pool_from_the_free_memory_on_gpu():
    """On CUDA a pool without kv_tokens takes what the memory fraction leaves beside the
    weights, the draft's cache and the steps' reserve, counting the engine's store of the
    draft's keys for prefix hits (to within the allocator's rounding), and gives the rows'
    tokens and accept counts."""
    from dcp_compile.memory import GiB, step_reserve_bytes

    group = dcp.init_group("cuda")

    def decoder(**paging):
        target, draft = agreeing_pair("eagle3", noise=3.0, max_batch=3)
        return dcp.SpecDecoder(target.cuda(), draft.cuda(), group, k=3, max_batch=3, max_seq_len=96,
                               lowering="aot_eager", **paging)

    arrivals = [(0, p, SamplingParams(max_new_tokens=12)) for p in PROMPTS]
    expected = run(SpecEngine(decoder()), arrivals)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    fraction = (total - free + step_reserve_bytes(3, 4, 32) + GiB) / total  # a pool of about 1 GiB
    paged = decoder(page_size=8, memory_fraction=fraction)
    engine = SpecEngine(paged)  # prefix caching: the draft's store of indexed pages, a token's worth per pool token
    assert engine.pages.draft_pages is not None
    in_use = total - torch.cuda.mem_get_info()[0]
    ceiling = fraction * total - step_reserve_bytes(3, 4, 32)
    assert ceiling - 64 * 2**20 <= in_use <= ceiling + 8 * 2**20, (in_use, ceiling)
    out = run(engine, arrivals)
    assert paged.paging.shape.kv_tokens > 3 * 96
    assert out["tokens"] == expected["tokens"] and out["accepted"] == expected["accepted"]


def test_a_draft_or_a_bshd_cache_is_not_paged():
    _, draft = agreeing_pair("eagle3", noise=3.0, max_batch=3)
    with pytest.raises(ValueError, match="the draft's cache stays whole"):
        dcp.prepare(draft, dcp.init_group("cpu"), "draft", max_batch=3, max_seq_len=96, page_size=8, kv_tokens=96)
    model = graphs.IndexPutBSHD()
    with pytest.raises(ValueError, match=r"page_size pages \[batch, heads, seq, head_dim\] caches"):
        dcp.prepare(model, dcp.init_group("cpu"), "target", max_batch=graphs.B, max_seq_len=graphs.S, page_size=4,
                    kv_tokens=64, example_inputs=graphs.inputs_for(model, 1))


def test_keys_computed_from_the_cache_are_refused_a_pool():
    """transformers' DeepSeek projects its cached latent into keys (a slot-wise map over the
    cache): its prefix would read the cache itself, which paging leaves without memory."""
    pytest.importorskip("transformers")
    from tests.hf.workers import agreeing_hf_pair

    target, draft = agreeing_hf_pair(3.0, family="deepseek_v3")
    with pytest.raises(GraphPatternError, match="computes its keys and values from the cache .* without page_size"):
        dcp.SpecDecoder(target, draft, dcp.init_group("cpu"), k=3, max_batch=4, max_seq_len=96, lowering="aot_eager",
                        page_size=4, kv_tokens=128)
    assert all(record_for(b) is None for b in target.buffers()), "refused before any cache was replaced"
