"""The shipped pair loads and is trained: it predicts held-out standard-library code."""

import torch
import torch.nn.functional as F

from dcp_compile.commands import training
from dcp_compile.models.pretrained import load_pair


def held_out_windows(n=4, length=256):
    data = training.load_corpus("held_out")
    return training.sample_windows(data, n, length, torch.Generator().manual_seed(0))


def test_shipped_pair_loads_with_the_servers_cache_shape():
    target, draft = load_pair("tiny-code", max_batch=3, max_seq_len=100)
    assert target.layers[0].attention.k_cache.shape == (3, 2, 100, 64)
    assert draft.attention.k_cache.shape == (3, 2, 100, 64)
    assert draft.cfg.kind == "eagle3" and target.cfg.aux_layers == (2, 4, 5)


def test_target_predicts_held_out_files_far_better_than_chance():
    target, _ = load_pair("tiny-code", max_batch=1, max_seq_len=256)
    windows = held_out_windows()
    with torch.no_grad():
        logits, _ = target.forward_uncached(windows[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert loss < 1.2, f"held-out loss {float(loss):.3f} nats/byte (uniform bytes: {torch.log(torch.tensor(256.)):.2f})"


def test_draft_agrees_with_the_target_on_held_out_files():
    target, draft = load_pair("tiny-code", max_batch=1, max_seq_len=260)
    windows = held_out_windows()
    with torch.no_grad():
        _, agreements = training.draft_losses(target, draft, windows, ttt_steps=4)
    assert all(a > 0.6 for a in agreements), [round(float(a), 3) for a in agreements]


def test_short_generation_is_printable_source_text():
    target, _ = load_pair("tiny-code", max_batch=1, max_seq_len=64)
    from dcp_compile.runtime.generate import greedy_decode

    prompt = list(b"import sys\n\n\ndef main():\n    ")
    with torch.no_grad():
        result = greedy_decode(lambda t, p: target(t, p)[0], [prompt], 24)
    text = bytes(result.tokens[0].tolist())
    assert all(32 <= b < 127 or b in (9, 10) for b in text), text
    assert text.strip(), "only whitespace after a function header"
