"""Transformers' ``generate()`` as a serving loop calls it, under DCP at 2 and 3 ranks:
one model compiled once answers batches of many prompt widths (left-padded, up to the
cache's end) with transformers' own tokens (its ``StaticCache``, one process), through
one prefill-chunk graph and one decode graph; seeded sampling, ``eos_token_id`` and a
``TextIteratorStreamer`` work as in transformers; bad requests are refused before
anything is written, and the next call works.

One spawn per group size serves every test here (on 2 CPU cores: about 15 s at DCP=2
and 25 s at DCP=3 for the 50 widths, compiles included).
"""

import pytest
import torch

from dcp_compile.runtime.launch import spawn_ranks

pytest.importorskip("transformers")

from tests.hf.any_width import CHUNK, NEW_TOKENS, ROWS, reference, serving_worker, widths  # noqa: E402
from tests.hf.workers import MAX_SEQ_LEN  # noqa: E402

N_WIDTHS = 50
N_SAMPLED = 3


@pytest.fixture(scope="module")
def expected():
    return reference(N_WIDTHS, N_SAMPLED)


@pytest.fixture(scope="module")
def served(expected):
    cache = {}

    def get(size):
        if size not in cache:
            cache[size] = spawn_ranks(serving_worker, size, N_WIDTHS, N_SAMPLED, expected["eos_tokens"], timeout=1200)
        return cache[size]

    return get


def test_the_widths_cover_the_cache():
    chosen = widths(N_WIDTHS)
    assert len(set(chosen)) == N_WIDTHS and max(chosen) == MAX_SEQ_LEN - NEW_TOKENS and min(chosen) >= 1
    assert any(w > 2 * CHUNK for w in chosen), "some prompts take several chunks"


@pytest.mark.parametrize("size", [2, 3])
def test_every_width_gives_transformers_greedy_tokens(size, expected, served):
    for rank, r in enumerate(served(size)):
        for width, got, want in zip(widths(N_WIDTHS), r["greedy"], expected["greedy"]):
            assert torch.equal(got, want), f"rank {rank}, width {width}: tokens differ from transformers'"
    seconds = sorted(served(size)[0]["seconds"][1:])
    print(f"DCP={size}: {N_WIDTHS} widths, median {seconds[len(seconds) // 2]:.3f} s a call after the first "
          f"({served(size)[0]['seconds'][0]:.1f} s with its compiles)")


@pytest.mark.parametrize("size", [2, 3])
def test_no_compile_after_the_first_prefill_chunk_and_decode_step(size, served):
    for rank, r in enumerate(served(size)):
        assert r["graphs_after_first_call"] == 2, f"rank {rank}: the first call compiles a chunk and a decode graph"
        assert r["graphs"] == 2 and r["compiled"] == 2, f"rank {rank}: a later call compiled a graph"
        assert r["collectives"] == [4, 4], "all-gather + wait per layer, in each graph"
    assert served(size)[0]["local_cache"][:3] == (ROWS, 2, -(-MAX_SEQ_LEN // size) + 1), "this rank's shard"


@pytest.mark.parametrize("size", [2, 3])
def test_padded_sites_run_the_length_bounded_kernels(size, served):
    """The left-padded batches run ``dcp::prefix_attention`` and ``dcp::window_attention``
    with their bound, not the masked reference attention."""
    for counts in served(size)[0]["prefix_kernels"]:
        assert counts == {"prefix": 2, "window": 2}, counts


@pytest.mark.parametrize("size", [2, 3])
def test_sampling_eos_and_streaming_work_as_in_transformers(size, expected, served):
    for rank, r in enumerate(served(size)):
        for i, (got, want) in enumerate(zip(r["sampled"], expected["sampled"], strict=True)):
            assert torch.equal(got, want), f"rank {rank}, sampled call {i}: tokens differ from transformers'"
        for i, (got, want) in enumerate(zip(r["eos"], expected["eos"], strict=True)):
            assert torch.equal(got, want), f"rank {rank}, eos call {i}: tokens differ from transformers'"
            assert (got[0, widths(N_WIDTHS)[i] + 3:] == 0).all(), "row 0 stops at its eos token and is padded"
        assert torch.equal(r["one_row"], expected["one_row"]), "a batch of one row of the cache's two"
        assert r["streamed"] == r["one_row_text"] and len(r["streamed"].split()) == NEW_TOKENS
    assert not torch.equal(expected["sampled"][0], expected["greedy"][0]), "sampling draws other tokens than greedy"


@pytest.mark.parametrize("size", [2, 3])
def test_a_mask_that_is_not_left_padding_runs_the_masked_reference(size, expected, served):
    """Never run as a bound: the table goes into two graphs of its own, whose sites run
    the masked reference attention, and the tokens are transformers' with that mask."""
    for rank, r in enumerate(served(size)):
        assert torch.equal(r["holed"], expected["holed"]), f"rank {rank}: tokens differ from transformers'"
        assert r["holed_kernels"] == [{"masked reference": 4}] * 2, r["holed_kernels"]


REFUSALS = {
    "batch larger than the cache": "batch of 3 rows",
    "prompt plus new tokens past the cache": "past the cache's max_cache_len=64",
    "mask of another width": "attention_mask must be [batch, tokens] = [2, 20]",
    "ids on another device": "takes input_ids on the model's device (cpu), got it on meta",
    "transformers' StaticCache": "takes a DCPStaticCache, got",
    "no cache, none sized": "compile_for_generate(model, group, max_batch_size=B, max_cache_len=S)",
}


def test_bad_requests_are_refused_before_anything_is_written(served, expected):
    for rank, r in enumerate(served(2)):
        for name, message in REFUSALS.items():
            assert r["errors"][name] is not None, f"rank {rank}: {name} was not refused"
            assert message in r["errors"][name], f"rank {rank}, {name}: {r['errors'][name]}"
            assert name not in r["untouched"] or r["untouched"][name], f"rank {rank}, {name}: the cache was written"
        assert torch.equal(r["after_refusals"], expected["greedy"][0]), "the next call works"


@pytest.mark.parametrize("cascade", [True, False], ids=["one-rank cascade", "plain torch.compile"])
def test_a_last_chunk_past_the_cache_starts_earlier(cascade):
    """A group of one, in one process: a cache of 64 slots and chunks of 24, so a prompt
    of 49 to 56 tokens would take a last chunk of positions 48..71; it starts at 40
    instead and writes 40..47 again.  The cascade runs the bound through the same ops
    as the DCP ranks; plain ``torch.compile`` (the off arm) runs transformers' SDPA on
    the mask the graph builds from the bound."""
    from transformers import StaticCache

    from dcp_compile.group import DCPGroup
    from dcp_compile.hf import cache_kwarg, compile_for_generate
    from tests.hf.any_width import batch
    from tests.hf.workers import make_hf_model

    reference = make_hf_model("llama")
    kw = cache_kwarg(reference)
    model = make_hf_model("llama")
    backend = compile_for_generate(model, DCPGroup(1, 0, torch.device("cpu"), None), lowering="aot_eager",
                                   cascade=cascade, chunk_size=24, max_batch_size=ROWS, max_cache_len=MAX_SEQ_LEN)
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for width in (1, 23, 24, 25, 47, 49, 56):
            ids, mask = batch(width)
            cache = StaticCache(config=reference.config, max_cache_len=MAX_SEQ_LEN)
            want = reference.generate(ids, attention_mask=mask, disable_compile=True, **{kw: cache}, **options)
            assert torch.equal(model.generate(ids, attention_mask=mask, **options), want), f"width {width}"
    assert len(backend.compiled) == 2
