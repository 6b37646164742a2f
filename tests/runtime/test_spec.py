"""Acceptance rules and the SpecDecoder's input checks (single process)."""

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.models import DraftConfig, EagleDraft, LlamaConfig
from dcp_compile.runtime.sampling import accept_chain
from dcp_compile.passes.fx_utils import GraphPatternError
from dcp_compile.runtime.spec import SpecDecoder
from tests.support import agreeing_pair, make_model

# chi-square critical value, 4 degrees of freedom, p = 0.001
CHI2_CRITICAL_DF4 = 18.467


def test_greedy_accepts_the_matching_prefix_plus_the_target_token():
    target_logits = torch.full((3, 4, 6), -5.0)
    # target argmax after t0, d1, d2, d3: rows choose different tokens
    target_argmax = torch.tensor([[1, 2, 3, 4], [1, 5, 3, 4], [0, 2, 3, 4]])
    target_logits.scatter_(2, target_argmax[..., None], 5.0)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    accepted, nxt = accept_chain(target_logits, drafts, None, 0.0, None)
    assert accepted.tolist() == [3, 1, 0]
    assert nxt.tolist() == [4, 5, 0]


def test_rejection_sampling_preserves_the_target_distribution():
    """The first emitted token follows p, whatever the draft q proposes."""
    vocab, k, n = 5, 2, 60000
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.tensor([[0.3, 1.2, -0.5, 0.8, 0.0], [1.0, 0.0, 0.5, -1.0, 0.2], [0.0, 0.4, 0.4, 0.1, -0.3]])
    draft_logits = torch.tensor([[1.5, -0.5, 0.5, 0.0, 0.7], [0.0, 1.0, -0.2, 0.3, 0.9]])
    temperature = 0.9
    p = torch.softmax(target_logits.double() / temperature, -1)
    q = torch.softmax(draft_logits.double() / temperature, -1)
    drafts = torch.multinomial(q.expand(n, k, vocab).reshape(-1, vocab), 1, replacement=True, generator=gen).view(n, k)
    accepted, nxt = accept_chain(target_logits.expand(n, k + 1, vocab), drafts, q.expand(n, k, vocab), temperature, gen)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    observed = torch.bincount(first, minlength=vocab).double()
    expected = n * p[0]
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRITICAL_DF4, f"first-token histogram {observed.tolist()} vs expected {expected.tolist()}"
    # the test has power: the draft's own distribution is rejected by the same statistic
    chi2_q = float(((observed - n * q[0]) ** 2 / (n * q[0])).sum())
    assert chi2_q > 10 * CHI2_CRITICAL_DF4
    assert 0 < accepted.double().mean() < k


def decoder(**overrides):
    target, draft = agreeing_pair("eagle3", noise=3.0)
    args = dict(k=2, max_batch=4, max_seq_len=96, lowering="aot_eager") | overrides
    return SpecDecoder(target, draft, dcp.init_group("cpu"), **args)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(k=0), r"k \(the draft depth: draft tokens per step for a chain\) must be an int >= 1"),
        (dict(topk=0), "topk must be >= 1, got topk=0; topk=1 with draft_tokens=k is the chain"),
        (dict(k=3, topk=2, draft_tokens=2), "draft_tokens=2 is below the depth k=3"),
        (dict(k=3, topk=2, draft_tokens=11), r"more than a tree of depth k=3 and topk=2 holds .* = 10 candidates"),
        (dict(k=2, topk=2, draft_tokens=4, tree=False), "tree=False asks for a chain, but topk=2 and draft_tokens=4"),
        (dict(k=5, topk=4, draft_tokens=60, max_seq_len=48), "verifies 61 new tokens per step, more than a cache of "
                                                              "max_seq_len=48 holds"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
    ],
)
def test_bad_decoder_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        decoder(**overrides)


def test_a_bad_tree_leaves_both_models_unprepared():
    target, draft = agreeing_pair("eagle3", noise=3.0)
    with pytest.raises(ValueError, match="draft_tokens=1 is below the depth k=2"):
        SpecDecoder(target, draft, dcp.init_group("cpu"), k=2, topk=2, draft_tokens=1, max_batch=4, max_seq_len=96)
    assert target.layers[0].attention.k_cache.shape[2] == 96, "nothing was prepared"
    SpecDecoder(target, draft, dcp.init_group("cpu"), k=2, topk=2, draft_tokens=4, max_batch=4, max_seq_len=96,
                lowering="aot_eager")
    assert target.layers[0].attention.k_cache.shape[2] == 96 + 1 + 5, "a tree target stages on a group of one"


def test_tree_arguments_without_a_draft_are_refused():
    target, _ = agreeing_pair("eagle3", noise=3.0)
    with pytest.raises(ValueError, match="which need a draft; without one"):
        SpecDecoder(target, None, dcp.init_group("cpu"), k=0, topk=2, max_batch=4, max_seq_len=96)


def test_an_mla_target_is_refused_a_tree_before_anything_is_prepared():
    target, draft = agreeing_pair("eagle3", noise=3.0, target="mla")
    with pytest.raises(GraphPatternError, match="MLA's latent cache, whose window takes no tree mask yet"):
        SpecDecoder(target, draft, dcp.init_group("cpu"), k=2, topk=2, draft_tokens=4, max_batch=4, max_seq_len=96,
                    lowering="aot_eager")


@pytest.mark.parametrize(
    "overrides,message",
    [(dict(cuda_graphs=True), "cuda_graphs=True needs a CUDA device"), (dict(chunk_size=0), "chunk_size")],
)
def test_a_bad_argument_leaves_both_models_unprepared(overrides, message):
    target, draft = agreeing_pair("eagle3", noise=3.0)
    with pytest.raises(ValueError, match=message):
        SpecDecoder(target, draft, dcp.init_group("cpu"), k=2, max_batch=4, max_seq_len=96, **overrides)
    # The same models still make a working decoder: nothing was prepared.
    SpecDecoder(target, draft, dcp.init_group("cpu"), k=2, max_batch=4, max_seq_len=96, lowering="aot_eager")


def test_draft_for_another_vocabulary_is_refused():
    cfg = LlamaConfig(aux_layers=(2,))
    other = EagleDraft(DraftConfig(LlamaConfig(vocab_size=128), "eagle"))
    with pytest.raises(ValueError, match="target vocabulary of 128 tokens but the target has 256"):
        SpecDecoder(make_model(cfg), other, dcp.init_group("cpu"), k=2, max_batch=3, max_seq_len=64)


def test_too_long_request_is_refused_and_the_others_are_untouched():
    prompts = [[1, 2, 3], list(range(32)) * 3, [4, 5]]
    together = dcp.generate_all(decoder(), prompts, 10)
    torch._dynamo.reset()
    alone = dcp.generate_all(decoder(), [prompts[0], prompts[2]], 10)
    assert together[1].finished_by == "refused" and together[1].tokens == []
    assert "needs 109 cache positions; the cache holds max_seq_len=96" in together[1].error
    assert [together[0].tokens, together[2].tokens] == [alone[0].tokens, alone[1].tokens]
    assert [together[0].accepted, together[2].accepted] == [alone[0].accepted, alone[1].accepted]


def test_eos_stops_a_request():
    outputs = dcp.generate_all(decoder(), [[7, 7, 7]], 30)
    eos = outputs[0].tokens[4]
    torch._dynamo.reset()
    stopped = dcp.generate_all(decoder(), [[7, 7, 7]], 30, eos_id=eos)[0]
    assert stopped.finished_by == "eos" and stopped.tokens[-1] == eos
    assert stopped.tokens == outputs[0].tokens[: outputs[0].tokens.index(eos) + 1]


def test_requests_that_exactly_fill_the_cache_run_to_the_end():
    # Rows finish at different steps; a finished row must not be verified past its cache.
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 32, (10,), generator=gen).tolist() for _ in range(4)]
    k, new = 4, 39  # the first row overshoots its budget by two tokens at its last step
    max_seq_len = max(len(p) for p in prompts) + new + k + 1
    target, draft = agreeing_pair("eagle3", noise=3.0, max_seq_len=max_seq_len)
    dec = SpecDecoder(target, draft, dcp.init_group("cpu"), k=k, max_batch=4, max_seq_len=max_seq_len, lowering="aot_eager")
    outputs = dcp.generate_all(dec, prompts, new)
    assert [o.finished_by for o in outputs] == ["length"] * 4
    assert [len(o.tokens) for o in outputs] == [new] * 4


def test_the_loop_reads_the_device_once_per_step():
    """Host reads made by the loop itself (dcp_compile/runtime: not the backend's optional
    position check, nor the CPU kernels of the inserted ops, which a GPU runs in Triton):
    one after the prefill and one per verify step, whatever the batch."""
    import sys

    import dcp_compile as dcp
    from tests.support import agreeing_pair

    group = dcp.init_group("cpu")
    target, draft = agreeing_pair("eagle3", noise=3.0)
    decoder = SpecDecoder(target, draft, group, k=3, max_batch=4, max_seq_len=96, temperature=0.7, lowering="aot_eager")
    reads = []

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "dcp_compile/runtime" in caller:
                reads.append(name)
            return original(self, *args, **kwargs)

        return original, read

    names = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")
    saved = {}
    try:
        for name in names:
            saved[name], wrapper = counted(name)
            setattr(torch.Tensor, name, wrapper)
        outputs = dcp.generate_all(decoder, [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 11], 20)
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
    steps = max(len(o.accepted) for o in outputs)
    assert steps > 3 and all(o.finished_by == "length" for o in outputs)
    assert reads == ["tolist"] * (steps + 1), reads


def test_a_draft_for_other_features_is_refused():
    cfg = LlamaConfig(n_layers=4, aux_layers=(0, 1, 2))
    eagle = EagleDraft(DraftConfig(cfg, "eagle"))  # reads the final hidden state alone
    with pytest.raises(ValueError, match=r"reads target features 64 wide but the target returns 192"):
        SpecDecoder(make_model(cfg), eagle, dcp.init_group("cpu"), k=2, max_batch=3, max_seq_len=64)


def test_without_a_draft_the_decoder_emits_the_targets_greedy_tokens():
    """``draft=None, k=0``: one token per step, the target's argmax, prompts of several
    widths in one batch (prefill chunks narrower than the longest prompt)."""
    cfg = LlamaConfig(vocab_size=64, n_layers=2, max_seq_len=48, max_batch=3)
    target = make_model(cfg, 3)
    reference = make_model(cfg, 3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 11, 2)]
    new = 9
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(new):
                tokens.append(int(reference.forward_uncached(torch.tensor([tokens]))[0, -1].argmax()))
            expected.append(tokens[len(prompt):])
    plain = SpecDecoder(target, None, dcp.init_group("cpu"), k=0, max_batch=3, max_seq_len=48, lowering="aot_eager",
                        chunk_size=4)
    outputs = dcp.generate_all(plain, prompts, new)
    assert [o.tokens for o in outputs] == expected
    assert all(o.accepted == [0] * (new - 1) and o.finished_by == "length" for o in outputs)
    assert plain.draft_backend is None and len(plain.target_backend.compiled) == 1


def test_draft_tokens_without_a_draft_are_refused():
    with pytest.raises(ValueError, match="k=2, topk=1, draft_tokens=None and tree=None ask for draft tokens, which need a draft; without one"):
        SpecDecoder(make_model(LlamaConfig()), None, dcp.init_group("cpu"), k=2, max_batch=3, max_seq_len=64)
