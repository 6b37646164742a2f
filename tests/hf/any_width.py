"""Per-rank functions for ``test_hf_generate_widths.py``: transformers' ``generate()``
called as a serving loop calls it, on one model compiled once by ``compile_for_generate``
(importable by spawned ranks; ``transformers`` is imported inside the functions)."""

from __future__ import annotations

import threading
import time

import torch

import dcp_compile as dcp
from tests.hf.workers import MAX_SEQ_LEN, VOCAB, make_hf_model

ROWS, CHUNK, NEW_TOKENS = 2, 16, 8
"""The cache's batch, the prefill chunk, and the new tokens of every call."""
SAMPLING = dict(do_sample=True, temperature=0.9, top_k=0)


def widths(n: int) -> list[int]:
    """``n`` different prompt widths from 1 token to the cache's end (``MAX_SEQ_LEN -
    NEW_TOKENS``), in a shuffled order, the widest among them."""
    every = torch.randperm(MAX_SEQ_LEN - NEW_TOKENS, generator=torch.Generator().manual_seed(n)) + 1
    chosen = every[:n].tolist()
    if MAX_SEQ_LEN - NEW_TOKENS not in chosen:
        chosen[-1] = MAX_SEQ_LEN - NEW_TOKENS
    return chosen


def batch(width: int, rows: int = ROWS):
    """A left-padded batch of ``rows`` prompts ``width`` wide: row 0 fills it, the others
    are shorter (at least one token) with padding token 0 before them."""
    gen = torch.Generator().manual_seed(1000 + width)
    ids = torch.randint(1, VOCAB, (rows, width), generator=gen)
    mask = torch.ones(rows, width, dtype=torch.long)
    for row in range(1, rows):
        n = int(torch.randint(1, width + 1, (1,), generator=gen))
        ids[row, : width - n] = 0
        mask[row, : width - n] = 0
    return ids, mask


def holed_batch():
    """A batch whose mask is not left padding: row 0 has a masked token among its own."""
    ids, mask = batch(20)
    ids[0, 10], mask[0, 10] = 0, 0
    return ids, mask


def word_tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary (``t0 .. t127``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0")


def reference(n_widths: int, n_sampled: int):
    """Transformers' own ``generate()`` with its ``StaticCache``, one process, uncompiled:
    greedy for every width; seeded sampling and an ``eos_token_id`` run for the first
    ``n_sampled``; a one-row prompt for the streamer."""
    from transformers import StaticCache

    from dcp_compile.hf import cache_kwarg

    model = make_hf_model("llama")
    kw = cache_kwarg(model)

    def generate(ids, mask, seed=7, **options):
        torch.manual_seed(seed)
        with torch.no_grad():
            cache = StaticCache(config=model.config, max_cache_len=MAX_SEQ_LEN)
            return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0,
                                  disable_compile=True, **{kw: cache}, **options)

    out = dict(greedy=[], sampled=[], eos=[], eos_tokens=[])
    for i, width in enumerate(widths(n_widths)):
        ids, mask = batch(width)
        out["greedy"].append(generate(ids, mask, do_sample=False))
        if i < n_sampled:
            out["sampled"].append(generate(ids, mask, **SAMPLING))
            eos = int(out["greedy"][-1][0, width + 2])  # row 0's third new token
            out["eos_tokens"].append(eos)
            out["eos"].append(generate(ids, mask, do_sample=False, eos_token_id=eos))
    ids, mask = batch(13, rows=1)
    out["one_row"] = generate(ids, mask, do_sample=False)
    out["holed"] = generate(*holed_batch(), do_sample=False)
    return out


def serving_worker(rank: int, size: int, n_widths: int, n_sampled: int, eos_tokens: list[int]):
    """One model, compiled once, answering every call the test makes: ``n_widths`` greedy
    batches of different widths, then seeded sampling, ``eos_token_id`` and a streamer,
    then the requests that must be refused, then a greedy call again."""
    from torch._dynamo.utils import counters
    from transformers import StaticCache, TextIteratorStreamer

    from dcp_compile.hf import cache_kwarg, compile_for_generate

    group = dcp.init_group("cpu")
    model = make_hf_model("llama")
    backend = compile_for_generate(model, group, lowering="aot_eager", chunk_size=CHUNK, max_batch_size=ROWS,
                                   max_cache_len=MAX_SEQ_LEN)
    out = dict(greedy=[], sampled=[], eos=[], seconds=[], errors={}, untouched={})

    def generate(ids, mask, seed=7, **options):
        torch.manual_seed(seed)
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0, **options)

    for i, width in enumerate(widths(n_widths)):
        ids, mask = batch(width)
        start = time.perf_counter()
        out["greedy"].append(generate(ids, mask, do_sample=False))
        out["seconds"].append(time.perf_counter() - start)
        if i == 0:
            out["graphs_after_first_call"] = counters["stats"]["unique_graphs"]
    for i, width in enumerate(widths(n_widths)[:n_sampled]):
        ids, mask = batch(width)
        out["sampled"].append(generate(ids, mask, **SAMPLING))
        out["eos"].append(generate(ids, mask, do_sample=False, eos_token_id=eos_tokens[i]))

    # One row of the cache's two, streamed as text while it is generated.
    tokenizer = word_tokenizer()
    ids, mask = batch(13, rows=1)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result = {}
    thread = threading.Thread(target=lambda: result.update(tokens=generate(ids, mask, do_sample=False,
                                                                           streamer=streamer)))
    thread.start()
    out["streamed"] = "".join(streamer)
    thread.join()
    out["one_row"] = result["tokens"]
    out["one_row_text"] = tokenizer.decode(result["tokens"][0, ids.shape[1]:])

    cache = model.dcp_cache
    ids, mask = batch(20)

    def attempt(name, call):
        before = [b.clone() for b in cache.store.buffers()] + [cache.length.clone()]
        try:
            with torch.no_grad():
                call()
            out["errors"][name] = None
        except Exception as error:
            out["errors"][name] = str(error)
        after = list(cache.store.buffers()) + [cache.length]
        out["untouched"][name] = all(torch.equal(a, b) for a, b in zip(before, after))

    wide_ids, wide_mask = batch(MAX_SEQ_LEN - NEW_TOKENS + 1)
    attempt("batch larger than the cache", lambda: model.generate(
        torch.cat([ids, ids[:1]]), attention_mask=torch.cat([mask, mask[:1]]), max_new_tokens=3, pad_token_id=0))
    attempt("prompt plus new tokens past the cache", lambda: model.generate(
        wide_ids, attention_mask=wide_mask, max_new_tokens=NEW_TOKENS, pad_token_id=0))
    attempt("mask of another width", lambda: model.generate(
        ids, attention_mask=mask[:, 1:], max_new_tokens=3, pad_token_id=0))
    attempt("ids on another device", lambda: model.generate(
        ids.to("meta"), attention_mask=mask, max_new_tokens=3, pad_token_id=0))
    attempt("transformers' StaticCache", lambda: model.generate(
        ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0,
        **{cache_kwarg(model): StaticCache(config=model.config, max_cache_len=MAX_SEQ_LEN)}))
    unsized = make_hf_model("llama")
    compile_for_generate(unsized, group, lowering="aot_eager")
    try:
        unsized.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
        out["errors"]["no cache, none sized"] = None
    except ValueError as error:
        out["errors"]["no cache, none sized"] = str(error)
    out["after_refusals"] = generate(*batch(widths(n_widths)[0]), do_sample=False)

    out["graphs"] = counters["stats"]["unique_graphs"]
    out["compiled"] = len(backend.compiled)
    out["collectives"] = backend.collective_counts
    out["prefix_kernels"] = [_attention_ops(c.graph_module) for c in backend.compiled]
    out["local_cache"] = tuple(cache.store.k_0.shape)
    # A mask that is not left padding goes in as the table: two graphs more, on the
    # masked reference.
    out["holed"] = generate(*holed_batch(), do_sample=False)
    out["holed_kernels"] = [_attention_ops(c.graph_module) for c in backend.compiled[out["compiled"]:]]
    return out


def _attention_ops(gm) -> dict:
    """How many of each attention op a compiled graph calls."""
    from dcp_compile.ops.attention import attention_with_lse
    from dcp_compile.passes.shard_attention import PREFIX_ATTENTION, WINDOW_ATTENTION

    names = {PREFIX_ATTENTION: "prefix", WINDOW_ATTENTION: "window", attention_with_lse: "masked reference"}
    counts: dict = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in names:
            counts[names[node.target]] = counts.get(names[node.target], 0) + 1
    return counts
