"""Per-rank functions for the Hugging Face and gpt-fast tests (importable by spawned
ranks).  ``transformers`` is imported inside the functions that need it."""

from __future__ import annotations

import torch

import dcp_compile as dcp
from dcp_compile.models.llama import LlamaConfig, init_weights
from dcp_compile.runtime.generate import greedy_decode
from tests.support import make_prompts

VOCAB, MAX_SEQ_LEN = 128, 64
RAGGED_LENGTHS = (5, 11, 17)


def hf_config(family: str, **overrides):
    """A tiny random-init config: 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 128."""
    import transformers

    shapes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=MAX_SEQ_LEN, attn_implementation="sdpa")
    shapes.update(FAMILY_SHAPES.get(family, {}))
    shapes.update(overrides)
    return getattr(transformers, HF_FAMILIES[family] + "Config")(**shapes)


HF_FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3", "phi3": "Phi3",
               "granite": "Granite", "olmo2": "Olmo2", "gemma": "Gemma", "stablelm": "StableLm", "cohere": "Cohere",
               "gptneox": "GPTNeoX", "mixtral": "Mixtral", "gemma2": "Gemma2", "deepseek_v3": "DeepseekV3",
               "deepseek_v2": "DeepseekV2", "deepseek_v3_eager": "DeepseekV3",
               "minicpm3": "MiniCPM3", "glm4_moe_lite": "Glm4MoeLite"}
"""Test family -> transformers' class prefix (``Qwen3Config``, ``Qwen3ForCausalLM``)."""
_LATENT_ATTENTION = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=16, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16)
_DEEPSEEK = dict(_LATENT_ATTENTION, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=4,
                 num_experts_per_tok=2, n_group=1, topk_group=1)
FAMILY_SHAPES = {
    "mistral": dict(sliding_window=None),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=1),  # its defaults lie past a 128-token vocabulary
    "qwen3": dict(head_dim=16),  # Qwen3's default is 128 whatever the width
    "gemma": dict(head_dim=16),  # Gemma's default is 256
    "gptneox": dict(num_key_value_heads=None, rotary_pct=0.5),  # no grouped KV heads; rope on half of each head
    "mixtral": dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2),
    # multi-head latent attention: the cache holds a 32-wide latent and an 8-wide rope key;
    # dense MLPs first, then a layer of 4 routed experts
    "deepseek_v3": _DEEPSEEK,
    "deepseek_v2": {**_DEEPSEEK, "q_lora_rank": None},
    "deepseek_v3_eager": {**_DEEPSEEK, "attn_implementation": "eager"},
    "minicpm3": dict(_LATENT_ATTENTION, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # its default interleaves the rope pairs (rope_interleave=True)
    "glm4_moe_lite": dict(_LATENT_ATTENTION, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                          mlp_layer_types=["dense", "sparse"], pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # every layer global, so that only the logit softcapping stands in the way
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4096, layer_types=["full_attention"] * 2,
                   attn_implementation="eager"),
}


def make_hf_model(family: str, seed: int = 0, **overrides):
    import transformers

    config = hf_config(family, **overrides)
    torch.manual_seed(seed)
    return init_weights(getattr(transformers, HF_FAMILIES[family] + "ForCausalLM")(config), seed).eval()


def own_loop(forward, prompt: torch.Tensor, steps: int, cache_kwargs: dict):
    """The loop HF users write: prefill the prompt, then feed back the greedy token."""
    ids, tokens, logits = prompt, [], []
    for _ in range(steps + 1):
        last = forward(input_ids=ids, **cache_kwargs).logits[:, -1].float()
        ids = last.argmax(-1)[:, None]
        tokens.append(ids[:, 0])
        logits.append(last)
    return torch.stack(tokens, dim=1), torch.stack(logits)


def recompute_greedy(model, prompts, steps: int):
    """Reference for ragged prompts: each sequence alone, no cache, full recompute."""
    tokens, logits = [], []
    for prompt in prompts:
        seq, row_tokens, row_logits = list(prompt), [], []
        for _ in range(steps + 1):
            last = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
            seq.append(int(last.argmax()))
            row_tokens.append(seq[-1])
            row_logits.append(last)
        tokens.append(row_tokens)
        logits.append(torch.stack(row_logits))
    return torch.tensor(tokens), torch.stack(logits, dim=1)  # [B, steps+1], [steps+1, B, V]


def hf_parity_worker(rank, size, families, lowering, steps):
    """Per ``(family, wrapped)``, an HF model on ``size`` ranks against itself unsharded and eager."""
    group = dcp.init_group("cpu")
    return {family: _hf_parity(group, family, wrapped, lowering, steps) for family, wrapped in families}


def _hf_parity(group, family, wrapped, lowering, steps):
    """The user's own StaticCache loop (DCPStaticCache), and when ``wrapped``, ragged
    prompts through DCPCausalLM."""
    from transformers import StaticCache

    from dcp_compile.hf import DCPCausalLM, DCPStaticCache, cache_kwarg

    torch._dynamo.reset()
    model = make_hf_model(family)
    kwarg = cache_kwarg(model)
    prompt = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    backend = dcp.backend(group, lowering=lowering)
    model_c = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    cache = DCPStaticCache(model.config, group, max_batch_size=2, max_cache_len=MAX_SEQ_LEN)
    with torch.no_grad():
        ref_tokens, ref_logits = own_loop(model, prompt, steps, {kwarg: StaticCache(config=model.config, max_cache_len=MAX_SEQ_LEN)})
        tokens, logits = own_loop(model_c, prompt, steps, {kwarg: cache})
    result = dict(tokens=tokens, reference_tokens=ref_tokens, logits=logits, reference_logits=ref_logits,
                  collectives=backend.collective_counts, local_cache=tuple(cache.store.k_0.shape))
    if not wrapped:
        return result

    wrapper = DCPCausalLM(model, max_batch=len(RAGGED_LENGTHS), max_seq_len=MAX_SEQ_LEN)
    dcp.prepare(wrapper, group, max_batch=len(RAGGED_LENGTHS), max_seq_len=MAX_SEQ_LEN)
    wrapper_backend = dcp.backend(group, lowering=lowering)
    wrapper_c = torch.compile(wrapper, backend=wrapper_backend, fullgraph=True, dynamic=False)
    prompts = make_prompts(RAGGED_LENGTHS, vocab=VOCAB)
    with torch.no_grad():
        ragged = greedy_decode(wrapper_c, prompts, steps)
        ref_ragged_tokens, ref_ragged_logits = recompute_greedy(model, prompts, steps)
    return result | dict(
        ragged_tokens=ragged.tokens, reference_ragged_tokens=ref_ragged_tokens,
        ragged_logits=torch.stack(ragged.logits), reference_ragged_logits=ref_ragged_logits,
        wrapper_collectives=wrapper_backend.collective_counts, wrapper_cache=tuple(wrapper.kv.k_0.shape),
    )


def gpt_fast_worker(rank, size, steps):
    """The gpt-fast model file on ``size`` ranks against itself unsharded and eager; and
    a model whose causal-mask table is not lower triangular, refused at prepare."""
    from tests.hf.gpt_fast_model import ModelArgs, Transformer

    group = dcp.init_group("cpu")
    batch, max_seq_len = 2, 64

    def build():
        torch.manual_seed(0)
        model = init_weights(Transformer(ModelArgs()), 0).eval()
        model.setup_caches(batch, max_seq_len)
        return model

    model, reference = build(), build()
    prepared = dcp.prepare(model, group, max_batch=batch, max_seq_len=max_seq_len)
    backend = dcp.backend(group, lowering="aot_eager")
    model_c = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    prompt = torch.randint(0, ModelArgs.vocab_size, (batch, 9), generator=torch.Generator().manual_seed(4))

    def generate(forward):
        input_pos = torch.arange(prompt.shape[1])
        logits = forward(prompt, input_pos)[:, -1]
        out_logits, out_tokens = [logits], [logits.argmax(-1)]
        input_pos = torch.tensor([prompt.shape[1]])
        for _ in range(steps):
            logits = forward(out_tokens[-1][:, None], input_pos)[:, -1]
            out_logits.append(logits)
            out_tokens.append(logits.argmax(-1))
            input_pos = input_pos + 1
        return torch.stack(out_tokens, 1), torch.stack(out_logits)

    with torch.no_grad():
        tokens, logits = generate(model_c)
        ref_tokens, ref_logits = generate(reference)

    # gpt-fast's generate.py compiles prefill and decode_one_token with Inductor: the
    # prepared model must refuse them, not answer from this rank's shard.
    from tests.hf.gpt_fast_generate import compiled_like_generate_py

    decode_c, prefill_c = compiled_like_generate_py()
    generate_py_errors = {}
    routes = (("prefill", lambda: prefill_c(model, prompt, torch.arange(prompt.shape[1]))),
              ("decode_one_token", lambda: decode_c(model, prompt[:, :1], torch.tensor([prompt.shape[1]]))))
    for name, call in routes if size == 2 else ():  # an Inductor compile each: once is enough
        torch._dynamo.reset()
        try:
            with torch.no_grad():
                call()
            generate_py_errors[name] = None
        except Exception as error:
            generate_py_errors[name] = str(error)

    try:
        with torch.no_grad():
            model_c(torch.zeros(batch + 1, 1, dtype=torch.long), torch.tensor([prompt.shape[1]]))
        batch_error = None
    except Exception as error:  # Dynamo wraps the hook's ValueError
        batch_error = str(error)

    banded = build()
    banded.causal_mask = banded.causal_mask & ~torch.tril(torch.ones_like(banded.causal_mask), -8)
    try:
        dcp.prepare(banded, group, max_batch=batch, max_seq_len=max_seq_len)
        banded_error = None
    except ValueError as error:
        banded_error = str(error)
    return dict(tokens=tokens, reference_tokens=ref_tokens, logits=logits, reference_logits=ref_logits,
                collectives=backend.collective_counts, mask_buffers=prepared.mask_buffers,
                causal_mask=tuple(model.causal_mask.shape), banded_error=banded_error,
                generate_py_errors=generate_py_errors, batch_error=batch_error)


def agreeing_hf_pair(noise: float, seed: int = 0, max_batch: int = 4, max_seq_len: int = 96, family: str = "llama",
                     cache_device=None):
    """An HF target (wrapped) and an EAGLE3 draft that agree most of the time: the
    construction of ``tests.support.agreeing_pair``, on HF weights.  ``family``:
    ``"llama"``, or ``"deepseek_v3"`` (multi-head latent attention, dense MLPs), whose
    draft the user sizes (``draft_config`` asks for it)."""
    import transformers

    from dcp_compile.hf import DCPCausalLM
    from dcp_compile.models import EagleDraft, eagle3_aux_layers
    from dcp_compile.models.eagle import DraftConfig

    n_layers, vocab = 4, 32
    shapes = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=n_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_seq_len,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    if family == "deepseek_v3":
        shapes.update(FAMILY_SHAPES["deepseek_v3"], first_k_dense_replace=n_layers)
    config = getattr(transformers, HF_FAMILIES[family] + "Config")(**shapes)
    torch.manual_seed(seed)
    model = init_weights(getattr(transformers, HF_FAMILIES[family] + "ForCausalLM")(config), seed).eval()
    aux = eagle3_aux_layers(n_layers)
    target = DCPCausalLM(model, max_batch=max_batch, max_seq_len=max_seq_len, aux_layers=aux, cache_device=cache_device)
    if family == "llama":
        draft_config = target.draft_config("eagle3", n_features=len(aux))
    else:
        draft_config = DraftConfig(LlamaConfig(vocab_size=vocab, dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                               intermediate_size=96, max_seq_len=max_seq_len, max_batch=max_batch,
                                               aux_layers=aux), "eagle3")
    draft = init_weights(EagleDraft(draft_config), seed + 1).eval()
    with torch.no_grad():
        embedding = torch.randn(vocab, 64, generator=torch.Generator().manual_seed(seed + 2))
        model.model.embed_tokens.weight.copy_(embedding)
        model.lm_head.weight.copy_(4.0 * embedding / embedding.norm(dim=1, keepdim=True))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(noise)
            layer.mlp.down_proj.weight.mul_(noise)
        draft.embed.weight.copy_(embedding)
        draft.head.weight.copy_(model.lm_head.weight)
        draft.fc.weight.copy_(torch.cat([torch.eye(64) / len(aux)] * len(aux), dim=1))
        draft.attention.wo.weight.mul_(noise)
        draft.feed_forward.w2.weight.mul_(noise)
    return target, draft


def hf_spec_worker(rank, size, k, max_new_tokens, noise, family="llama"):
    """EAGLE3 chain speculative decoding with an HF target: the off arm (a group of one,
    on every rank) and the DCP arm on all ``size`` ranks."""
    group = dcp.init_group("cpu")
    off = _hf_spec(dcp.DCPGroup(1, 0, torch.device("cpu"), None), k, max_new_tokens, noise, family)
    torch._dynamo.reset()
    # Llama's DCP arm keeps its caches in a pool of 128 tokens (pages of 4 slots a rank):
    # the four requests need 18 pages of its 16, so one waits.  DeepSeek's projects its
    # cached latent (a slot-wise map), which paging refuses (test_paged_cache).
    paging = dict(page_size=4, kv_tokens=128) if family == "llama" else None
    return dict(off=off, dcp=_hf_spec(group, k, max_new_tokens, noise, family, paging))


def _hf_spec(group, k, max_new_tokens, noise, family, paging=None):
    from dcp_compile.passes.shard_attention import ALL_GATHER

    # A paged target's caches stay on meta until prepare pages them, as `loading.load(paged=True)` leaves them.
    target, draft = agreeing_hf_pair(noise, family=family, cache_device="meta" if paging else None)
    decoder = dcp.SpecDecoder(target, draft, group, k=k, max_batch=4, max_seq_len=96, lowering="aot_eager",
                              **(paging or {}))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in (3, 9, 14, 20)]
    outputs = dcp.generate_all(decoder, prompts, max_new_tokens)
    return dict(
        tokens=[o.tokens for o in outputs], accepted=[o.accepted for o in outputs],
        verify_all_gathers=[sum(n.target is ALL_GATHER for n in c.graph_module.graph.nodes)
                            for c in decoder.verify_backend.compiled],
        draft_collectives=decoder.draft_backend.collective_counts, paged=decoder.paging is not None,
    )


def hf_refusal_worker(rank, size):
    """A sharded DCPStaticCache written outside a dcp.backend graph: uncompiled, half
    compiled, or through torch.compile(model).generate(); each is refused before the
    write, and the compiled loop still answers as the model does without a cache."""
    from dcp_compile.hf import DCPStaticCache, cache_kwarg

    group = dcp.init_group("cpu")
    model = make_hf_model("llama")
    kw = cache_kwarg(model)
    prompt = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    cache = DCPStaticCache(model.config, group, max_batch_size=2, max_cache_len=MAX_SEQ_LEN)
    compiled = torch.compile(model, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True, dynamic=False)
    errors, untouched = {}, {}

    def attempt(name, call):
        before = [b.clone() for b in cache.store.buffers()]
        try:
            with torch.no_grad():
                call()
            errors[name] = None
        except Exception as error:
            errors[name] = str(error)
        untouched[name] = all(torch.equal(a, b) for a, b in zip(before, cache.store.buffers()))

    attempt("uncompiled prefill", lambda: model(input_ids=prompt, **{kw: cache}))
    attempt("generate", lambda: torch.compile(model).generate(prompt, past_key_values=cache, max_new_tokens=3,
                                                              do_sample=False))
    with torch.no_grad():
        prefill = compiled(input_ids=prompt, **{kw: cache}).logits[:, -1].float()
    token = prefill.argmax(-1)[:, None]
    attempt("uncompiled decode after a compiled prefill", lambda: model(input_ids=token, **{kw: cache}))
    try:
        with torch.no_grad():
            compiled(input_ids=torch.cat([token, token[:1]]), **{kw: cache})
        batch_error = None
    except Exception as error:
        batch_error = str(error)
    with torch.no_grad():
        decode = compiled(input_ids=token, **{kw: cache}).logits[:, -1].float()
        reference = model(input_ids=torch.cat([prompt, token], dim=1)).logits[:, -2:].float()
    return dict(errors=errors, untouched=untouched, logits=torch.stack([prefill, decode], 1), reference=reference,
                batch_error=batch_error)


def left_padded_prompts(lengths=(4, 9, 6), seed: int = 5):
    """A batch as HF users build it: prompts of different lengths, padded on the left
    with token 0, and the 2-D attention mask that marks the padding."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


GENERATE_RUNS = (("greedy", dict(do_sample=False)), ("sampled", dict(do_sample=True, temperature=0.9, top_k=0)),
                 ("eos", dict(do_sample=False)))


def hf_generate_runs(generate, eos_token: int, max_new_tokens: int = 8):
    """``generate(seed, **kwargs)`` for each of ``GENERATE_RUNS`` (the ``eos`` run stops
    at ``eos_token``)."""
    out = {}
    for name, options in GENERATE_RUNS:
        extra = dict(eos_token_id=eos_token) if name == "eos" else {}
        out[name] = generate(7, max_new_tokens=max_new_tokens, pad_token_id=0, **options, **extra)
    return out


def hf_generate_reference(eos_token: int, family: str = "llama"):
    """Transformers' own generate() with its StaticCache, one process, uncompiled."""
    from transformers import StaticCache

    from dcp_compile.hf import cache_kwarg

    model = make_hf_model(family)
    ids, mask = left_padded_prompts()
    kw = cache_kwarg(model)

    def generate(seed, **options):
        torch.manual_seed(seed)
        cache = StaticCache(config=model.config, max_cache_len=MAX_SEQ_LEN)
        return model.generate(ids, attention_mask=mask, **{kw: cache}, disable_compile=True, **options)

    return hf_generate_runs(generate, eos_token)


def generate_under_dcp(group, family: str, eos_token: int):
    """``model.generate()`` of ``family`` after ``compile_for_generate`` on a left-padded
    batch: the runs of ``hf_generate_runs``, and what they ran on."""
    from dcp_compile.hf import DCPStaticCache, cache_kwarg, compile_for_generate

    model = make_hf_model(family)
    kw = cache_kwarg(model)  # before compile_for_generate wraps forward
    backend = compile_for_generate(model, group, lowering="aot_eager")
    ids, mask = left_padded_prompts()
    cache = DCPStaticCache(model.config, group, max_batch_size=len(ids), max_cache_len=MAX_SEQ_LEN)

    def generate(seed, **options):
        cache.reset()
        torch.manual_seed(seed)
        return model.generate(ids, attention_mask=mask, **{kw: cache}, **options)

    with torch.no_grad():
        runs = hf_generate_runs(generate, eos_token)
    return model, kw, backend, cache, generate, runs


def hf_family_generate_worker(rank, size, family, eos_token):
    group = dcp.init_group("cpu")
    _, _, backend, cache, _, runs = generate_under_dcp(group, family, eos_token)
    return dict(runs=runs, collectives=backend.collective_counts, local_cache=tuple(cache.store.k_0.shape))


def hf_generate_worker(rank, size, eos_token):
    """``model.generate()`` under DCP after ``compile_for_generate``: the runs of
    ``hf_generate_runs``, the routes that must be refused, and the cache left untouched
    by each refusal."""
    from transformers import CompileConfig

    from dcp_compile.hf import DCPStaticCache

    group = dcp.init_group("cpu")
    model, kw, backend, cache, generate, runs = generate_under_dcp(group, "llama", eos_token)
    ids, mask = left_padded_prompts()
    errors, untouched = {}, {}

    def attempt(name, target, call):
        before = [b.clone() for b in target.store.buffers()]
        try:
            with torch.no_grad():
                call(target)
            errors[name] = None
        except Exception as error:
            errors[name] = str(error)
        untouched[name] = all(torch.equal(a, b) for a, b in zip(before, target.store.buffers()))

    def fresh(m=model, rows=len(ids)):
        return DCPStaticCache(m.config, group, max_batch_size=rows, max_cache_len=MAX_SEQ_LEN)

    common = dict(attention_mask=mask, max_new_tokens=3, pad_token_id=0)
    plain = make_hf_model("llama")
    attempt("beam search", fresh(), lambda c: model.generate(ids, **{kw: c}, num_beams=2, **common))
    attempt("beam search, rows to match", fresh(rows=2 * len(ids)),
            lambda c: model.generate(ids, **{kw: c}, num_beams=2, **common))
    attempt("assisted generation", fresh(), lambda c: model.generate(ids, **{kw: c}, assistant_model=plain, **common))
    plain = make_hf_model("llama")
    attempt("transformers' compile_config", fresh(plain),
            lambda c: plain.generate(ids, **{kw: c}, compile_config=CompileConfig(backend=dcp.backend(group)), **common))
    own = make_hf_model("llama")
    own.forward = torch.compile(own.forward, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True,
                                dynamic=False)
    attempt("forward compiled, generate's own 4-D mask", fresh(own),
            lambda c: own.generate(ids, **{kw: c}, disable_compile=True, **common))
    with torch.no_grad():
        after_refusals = generate(7, max_new_tokens=8, pad_token_id=0, do_sample=False)
    return dict(runs=runs, after_refusals=after_refusals, errors=errors, untouched=untouched,
                collectives=backend.collective_counts, local_cache=tuple(cache.store.k_0.shape))


def hf_eager_worker(rank, size, steps):
    """An HF Llama with attn_implementation="eager" (its attention written by hand:
    repeat_kv, matmul, additive mask, softmax, dropout, matmul) in the user's own
    StaticCache loop, sharded, against itself on transformers' StaticCache."""
    from transformers import StaticCache

    from dcp_compile.hf import DCPStaticCache, cache_kwarg

    group = dcp.init_group("cpu")
    model = make_hf_model("llama", attn_implementation="eager")
    kwarg = cache_kwarg(model)
    prompt = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    backend = dcp.backend(group, lowering="aot_eager")
    model_c = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    cache = DCPStaticCache(model.config, group, max_batch_size=2, max_cache_len=MAX_SEQ_LEN)
    with torch.no_grad():
        ref_tokens, ref_logits = own_loop(model, prompt, steps, {kwarg: StaticCache(config=model.config, max_cache_len=MAX_SEQ_LEN)})
        tokens, logits = own_loop(model_c, prompt, steps, {kwarg: cache})
    return dict(tokens=tokens, reference_tokens=ref_tokens, logits=logits, reference_logits=ref_logits,
                collectives=backend.collective_counts)
