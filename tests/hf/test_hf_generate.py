"""Transformers' own ``model.generate()`` under DCP, with a left-padded batch, against its
generate() with a ``StaticCache`` in one process; and the generate routes that must be
refused."""

import pytest
import torch

from dcp_compile.runtime.launch import spawn_ranks

pytest.importorskip("transformers")

from tests.hf.workers import (  # noqa: E402
    GENERATE_RUNS, MAX_SEQ_LEN, hf_family_generate_worker, hf_generate_reference, hf_generate_worker,
    left_padded_prompts,
)


def eos_from(reference_greedy: torch.Tensor, prompt_width: int) -> int:
    """A token the greedy reference emits at its third new step in row 0, so the ``eos``
    run stops that row early and pads it."""
    return int(reference_greedy[0, prompt_width + 2])


@pytest.fixture(scope="module")
def reference():
    ids, _ = left_padded_prompts()
    greedy = hf_generate_reference(eos_token=-1)["greedy"]
    eos = eos_from(greedy, ids.shape[1])
    return eos, hf_generate_reference(eos)


@pytest.fixture(scope="module")
def runs(reference):
    """One spawn per group size, shared by the tests below."""
    eos, _ = reference
    cache = {}

    def get(size):
        if size not in cache:
            cache[size] = spawn_ranks(hf_generate_worker, size, eos, timeout=900)
        return cache[size]

    return get


@pytest.mark.parametrize("size", [2, 3])
def test_generate_matches_transformers_static_cache(size, reference, runs):
    _, expected = reference
    ids, _ = left_padded_prompts()
    ranks = runs(size)
    for rank, r in enumerate(ranks):
        for name, _ in GENERATE_RUNS:
            assert torch.equal(r["runs"][name], expected[name]), f"rank {rank}, {name}: tokens differ from transformers'"
        assert torch.equal(r["after_refusals"], expected["greedy"]), "a refusal must not disturb the next correct call"
    eos_row = expected["eos"][0, ids.shape[1]:]
    assert (eos_row[3:] == 0).all() and len(eos_row) >= 3, "the eos run stops row 0 after its third token and pads it"
    assert not torch.equal(expected["eos"], expected["greedy"])
    assert not torch.equal(expected["sampled"], expected["greedy"]), "sampling draws other tokens than greedy"
    r = ranks[0]
    assert r["local_cache"][2] == -(-MAX_SEQ_LEN // size) + 1, "the cache holds this rank's shard"
    assert r["collectives"] == [4, 4], "a prefill and a decode graph: all-gather + wait per layer"


def test_generate_padding_matters(reference):
    """Without the padding mask the short rows attend to their pad tokens and answer
    otherwise: the parity above tests the key mask, not only the causal one."""
    from transformers import StaticCache

    from dcp_compile.hf import cache_kwarg
    from tests.hf.workers import make_hf_model

    _, expected = reference
    model = make_hf_model("llama")
    ids, mask = left_padded_prompts()
    with torch.no_grad():
        unmasked = model.generate(ids, attention_mask=torch.ones_like(mask), max_new_tokens=8, do_sample=False,
                                  pad_token_id=0, disable_compile=True,
                                  **{cache_kwarg(model): StaticCache(config=model.config, max_cache_len=MAX_SEQ_LEN)})
    assert not torch.equal(unmasked, expected["greedy"])


REFUSALS = {
    "beam search": "num_beams=2 asks for another mode: beam search",
    "beam search, rows to match": "num_beams=2 asks for another mode: beam search",
    "assisted generation": "assistant_model=",
    "transformers' compile_config": "dcp_compile.hf.compile_for_generate(model, group)",
    "forward compiled, generate's own 4-D mask": "dcp_compile.hf.compile_for_generate(model, group)",
}


def test_generate_refusals_name_the_fix(runs):
    for rank, r in enumerate(runs(2)):
        for route, expected in REFUSALS.items():
            assert r["errors"][route] is not None, f"rank {rank}: {route} was not refused"
            assert expected in r["errors"][route], f"rank {rank}, {route}: {r['errors'][route]}"
            assert r["untouched"][route], f"rank {rank}, {route}: the refusal wrote to the cache"


def test_generate_of_a_latent_attention_model():
    """DeepSeek-V3 (multi-head latent attention, a routed-expert layer) through generate()
    on a left-padded batch at two ranks: the padding is read at the global position each
    latent slot holds, and the tokens are transformers' own with its StaticCache."""
    expected = hf_generate_reference(eos_token=-1, family="deepseek_v3")
    ids, _ = left_padded_prompts()
    for rank, r in enumerate(spawn_ranks(hf_family_generate_worker, 2, "deepseek_v3", -1, timeout=900)):
        for name in ("greedy", "sampled"):
            assert torch.equal(r["runs"][name], expected[name]), f"rank {rank}, {name}: tokens differ from transformers'"
        assert r["local_cache"] == (len(ids), 1, MAX_SEQ_LEN // 2 + 1, 32), "the latent cache holds this rank's shard"
        assert r["collectives"] == [4, 4], "a prefill and a decode graph: all-gather + wait per layer"
