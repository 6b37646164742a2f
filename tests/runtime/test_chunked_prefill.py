"""Long prompts: a fixed-shape chunked prefill, its parity, its memory bound and its
recompiles."""

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.runtime.generate import prefill_chunks
from dcp_compile.runtime.launch import spawn_ranks
from tests.runtime.workers import chunked_parity_worker, chunked_spec_worker, long_prefill_memory_worker
from tests.support import FP32_TOLERANCE, agreeing_pair

# Rows longer than one chunk next to rows shorter than one; 7 divides none of them.
RAGGED = (5, 17, 30)


def test_chunks_cover_each_prompt_once_and_pad_inside_the_cache():
    prompts = [[1, 2, 3], list(range(1, 11)), [9]]
    chunks = list(prefill_chunks(prompts, 4, 11, "cpu"))
    assert len(chunks) == 3
    for row, prompt in enumerate(prompts):
        seen = [int(c.tokens[row, t]) for c in chunks for t in range(4) if int(c.positions[row, t]) < len(prompt)]
        assert seen == prompt
        assert [bool(c.ends[row]) for c in chunks].count(True) == 1
        end = next(c for c in chunks if c.ends[row])
        assert int(end.positions[row, end.last[row]]) == len(prompt) - 1
        assert int(end.next_tokens[row, end.last[row]]) == 0, "the token after a prompt is the caller's to sample"
    assert all(int(c.positions.max()) <= 10 for c in chunks), "padding is clamped below max_seq_len"
    assert all(c.tokens.shape == (3, 4) for c in chunks)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_chunk_size_below_one_is_refused(chunk_size):
    with pytest.raises(ValueError, match="chunk_size .* must be an int >= 1"):
        list(prefill_chunks([[1, 2]], chunk_size, 16, "cpu"))


def test_chunk_larger_than_the_cache_is_refused_before_any_model_is_touched():
    group = dcp.init_group("cpu")
    target, draft = agreeing_pair("eagle3", noise=1.0)
    buffers = {n: b for n, b in target.named_buffers()}
    with pytest.raises(ValueError, match=r"chunk_size=97 is larger than the cache \(max_seq_len=96\)"):
        dcp.SpecDecoder(target, draft, group, k=3, max_batch=4, max_seq_len=96, chunk_size=97, lowering="aot_eager")
    assert all(b is buffers[n] for n, b in target.named_buffers()), "the target was not prepared"


@pytest.mark.parametrize("size,chunk_size,interleave", [(2, 7, 1), (3, 4, 2), (3, 64, 1)])
def test_chunked_prefill_then_decode_matches_the_unsharded_model(size, chunk_size, interleave):
    results = spawn_ranks(chunked_parity_worker, size, chunk_size, RAGGED, 12, interleave, timeout=600)
    for rank, r in enumerate(results):
        assert torch.equal(r["tokens"], r["reference_tokens"]), f"rank {rank}: tokens differ"
        torch.testing.assert_close(r["logits"], r["reference_logits"], **FP32_TOLERANCE)
        assert torch.equal(r["logits"], results[0]["logits"])
        assert r["graphs"] == 2, "one prefill-chunk graph and one decode graph"


SPEC_LENGTHS, SPEC_CHUNK = (3, 11, 26, 40), 9


@pytest.fixture(scope="module")
def chunked_off_arm():
    """The off arm (a group of one), shared by both group sizes."""
    return spawn_ranks(chunked_spec_worker, 1, SPEC_CHUNK, SPEC_LENGTHS, 0.0, timeout=600)[0]


@pytest.mark.parametrize("size", [2, 3])
def test_chunked_speculative_decoding_matches_the_off_arm(size, chunked_off_arm):
    off = chunked_off_arm
    dcp_arm = spawn_ranks(chunked_spec_worker, size, SPEC_CHUNK, SPEC_LENGTHS, 0.0, timeout=600)
    for r in dcp_arm:
        assert r["tokens"] == off["tokens"] and r["accepted"] == off["accepted"]
    assert off["finished"] == ["length"] * 4
    assert len({a for row in off["accepted"] for a in row}) >= 3, "the batch must exercise several accept counts"


def test_long_prompt_prefill_memory_is_bounded_by_the_chunk():
    prompt_len = 6000
    results = spawn_ranks(long_prefill_memory_worker, 2, prompt_len, 256, timeout=600)
    # One head's T x T fp32 score matrix: what an unchunked dense window would hold
    # (times the heads, and again for the softmax).
    scores_bytes = prompt_len * prompt_len * 4
    for r in results:
        assert r["chunks"] == -(-prompt_len // 256)
        assert r["logits_finite"]
        assert r["peak_growth"] < scores_bytes, f"prefill grew the peak by {r['peak_growth'] / 2**20:.0f} MiB"


def test_one_decoder_serves_twenty_prompt_widths_without_recompiling():
    from torch._dynamo.utils import counters

    group = dcp.init_group("cpu")
    target, draft = agreeing_pair("eagle3", noise=3.0, max_batch=2, max_seq_len=96)
    decoder = dcp.SpecDecoder(target, draft, group, k=3, max_batch=2, max_seq_len=96, chunk_size=16,
                              lowering="aot_eager")
    gen = torch.Generator().manual_seed(0)
    widths = list(range(3, 63, 3))
    assert len(set(widths)) == 20
    compiled_after_first = None
    for i, width in enumerate(widths):
        prompts = [torch.randint(0, 32, (width,), generator=gen).tolist(), [7, 8]]
        outputs = dcp.generate_all(decoder, prompts, 8)
        assert [o.finished_by for o in outputs] == ["length", "length"]
        if i == 0:
            compiled_after_first = (sum(len(b.compiled) for b in (decoder.target_backend, decoder.verify_backend,
                                                                  decoder.draft_backend)),
                                    counters["stats"]["unique_graphs"])
    compiled_now = (sum(len(b.compiled) for b in (decoder.target_backend, decoder.verify_backend,
                                                  decoder.draft_backend)),
                    counters["stats"]["unique_graphs"])
    assert compiled_now == compiled_after_first, "a new prompt width recompiled a graph"
    assert compiled_now[0] == 5, "prefill chunk, verify, draft chunk, draft extend, draft step"
