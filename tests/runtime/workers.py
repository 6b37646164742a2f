"""Per-rank functions for the multi-rank runtime tests (importable by spawned ranks)."""

import torch

import dcp_compile as dcp
from dcp_compile.models import LlamaConfig
from tests.support import make_model
from tests.passes import graphs


def idiom_worker(rank, size, module_name):
    """A gpt-fast / HF / [B,S,H,D] attention module, sharded, against itself unsharded."""
    group = dcp.init_group("cpu")
    module_cls = getattr(graphs, module_name)
    torch.manual_seed(0)
    model = module_cls()
    reference = module_cls()
    reference.load_state_dict(model.state_dict())
    prepared = dcp.prepare(
        model, group, "target", max_batch=graphs.B, max_seq_len=graphs.S, example_inputs=graphs.inputs_for(model, 1)
    )
    compiled = torch.compile(model, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(5)
    outs, refs = [], []
    steps = [(0, 5)] + [(p, 1) for p in range(5, 12)]
    with torch.no_grad():
        for start, tokens in steps:
            x = torch.randn(graphs.B, tokens, graphs.D, generator=gen)
            pos = torch.arange(start, start + tokens)
            if module_cls is graphs.IndexPutBSHD:
                pos = pos.expand(graphs.B, tokens).contiguous()
            outs.append(compiled(x, pos))
            refs.append(reference(x, pos))
    return dict(outs=outs, refs=refs, mask_buffers=prepared.mask_buffers, buffers={n: tuple(b.shape) for n, b in model.named_buffers()})


def layout_worker(rank, size, max_seq_len):
    """Target caches after prepare, a draft's caches, and the draft's compiled graph."""
    group = dcp.init_group("cpu")
    cfg = LlamaConfig(max_seq_len=max_seq_len)
    target = make_model(cfg)
    target_prepared = dcp.prepare(target, group, "target", max_batch=cfg.max_batch, max_seq_len=max_seq_len)
    draft_cfg = LlamaConfig(n_layers=1, max_seq_len=max_seq_len)
    draft = make_model(draft_cfg, seed=3)
    draft_reference = make_model(draft_cfg, seed=3)
    dcp.prepare(draft, group, "draft", max_batch=cfg.max_batch, max_seq_len=max_seq_len)
    draft_backend = dcp.backend(group, "draft", lowering="aot_eager")
    draft_c = torch.compile(draft, backend=draft_backend, fullgraph=True, dynamic=False)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.max_batch, 4), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(4).expand(cfg.max_batch, 4).contiguous()
    with torch.no_grad():
        draft_out, draft_ref = draft_c(tokens, positions), draft_reference(tokens, positions)
    try:
        with torch.no_grad():
            target(tokens, positions)
        eager_error = None
    except RuntimeError as error:
        eager_error = str(error)
    return dict(
        target_caches=[tuple(b.shape) for n, b in target.named_buffers() if "cache" in n],
        target_bytes=target_prepared.kv_bytes,
        draft_caches=[tuple(b.shape) for n, b in draft.named_buffers() if "cache" in n],
        draft_collectives=sum(draft_backend.collective_counts),
        draft_graphs=len(draft_backend.compiled),
        draft_close=torch.allclose(draft_out, draft_ref, rtol=1.3e-6, atol=1e-5),
        draft_prefix_reads=sum(
            n.target is torch.ops.dcp.prefix_attention.default for n in draft_backend.compiled[0].graph_module.graph.nodes
        ),
        eager_error=eager_error,
    )


def mismatch_worker(rank, size):
    group = dcp.init_group("cpu")
    cfg = LlamaConfig(n_layers=3 if rank == 1 else 2)
    try:
        dcp.prepare(make_model(cfg), group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
    except ValueError as error:
        return str(error)
    return None


def verify_commit_worker(rank, size, k, rounds, seed):
    """Prefill, then rounds of verify (k+1 tokens) + commit of a random accept count,
    against the unsharded eager model fed the same tokens."""
    from dcp_compile.runtime.commit import KVCommit
    from dcp_compile.runtime.generate import pad_prompts
    from tests.support import make_prompts

    group = dcp.init_group("cpu")
    cfg = LlamaConfig()
    reference, model = make_model(cfg), make_model(cfg)
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len, verify_tokens=k + 1)
    decode = torch.compile(model, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True, dynamic=False)
    verify_backend = dcp.backend(group, verify=True, lowering="aot_eager")
    verify = torch.compile(model, backend=verify_backend, fullgraph=True, dynamic=False)
    commit = KVCommit(model)
    commit_c = torch.compile(commit, backend="aot_eager", fullgraph=True, dynamic=False)
    caches = [b for n, b in model.named_buffers() if "cache" in n]
    readable = caches[0].shape[2] - (k + 1)  # slots [0, S_loc] hold committed tokens and the trash slot

    gen = torch.Generator().manual_seed(seed)
    tokens, positions, lengths = pad_prompts(make_prompts(), "cpu")
    outs, refs, untouched = [], [], []
    with torch.no_grad():
        outs.append(decode(tokens, positions))
        refs.append(reference(tokens, positions))
        start = lengths.clone()
        for _ in range(rounds):
            proposal = torch.randint(0, cfg.vocab_size, (cfg.max_batch, k + 1), generator=gen)
            pos = start[:, None] + torch.arange(k + 1)
            before = [c[:, :, :readable].clone() for c in caches]
            outs.append(verify(proposal, pos))
            refs.append(reference(proposal, pos))
            untouched.append(all(torch.equal(b, c[:, :, :readable]) for b, c in zip(before, caches)))
            accepted = torch.randint(1, k + 2, (cfg.max_batch,), generator=gen)
            if commit.needed:
                commit_c(start, accepted)
            start = start + accepted
        token = torch.randint(0, cfg.vocab_size, (cfg.max_batch, 1), generator=gen)
        outs.append(decode(token, start[:, None]))
        refs.append(reference(token, start[:, None]))
    return dict(outs=outs, refs=refs, untouched=untouched, commit_needed=commit.needed,
                verify_graph=verify_backend.compiled[0].graph_module.code)


def verify_overflow_worker(rank, size):
    """A verify graph with more new tokens than prepare reserved staging slots for."""
    group = dcp.init_group("cpu")
    cfg = LlamaConfig()
    model = make_model(cfg)
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len, verify_tokens=2)
    verify = torch.compile(model, backend=dcp.backend(group, verify=True, lowering="aot_eager"), fullgraph=True)
    tokens = torch.zeros(cfg.max_batch, 3, dtype=torch.long)
    try:
        with torch.no_grad():
            verify(tokens, torch.arange(3).expand(cfg.max_batch, 3))
    except Exception as error:  # Dynamo wraps the backend's ValueError
        return str(error)
    return None


def draft_and_aux_worker(rank, size, kind):
    """A DCP target returning EAGLE features, and a whole draft compiled on the same group."""
    from dcp_compile.models import DraftConfig, EagleDraft, eagle3_aux_layers
    from dcp_compile.models.llama import init_weights

    group = dcp.init_group("cpu")
    n_layers = 4
    aux = eagle3_aux_layers(n_layers) if kind == "eagle3" else (n_layers,)
    tcfg = LlamaConfig(n_layers=n_layers, aux_layers=aux)
    target, ref_target = make_model(tcfg), make_model(tcfg)
    dcp.prepare(target, group, "target", max_batch=tcfg.max_batch, max_seq_len=tcfg.max_seq_len)
    target_backend = dcp.backend(group, lowering="aot_eager")
    target_c = torch.compile(target, backend=target_backend, fullgraph=True, dynamic=False)

    dcfg = DraftConfig(tcfg, kind, n_features=len(aux), draft_vocab_size=64 if kind == "eagle3" else None)
    draft, ref_draft = (init_weights(EagleDraft(dcfg), 5).eval() for _ in range(2))
    if kind == "eagle3":
        for d in (draft, ref_draft):
            d.d2t.copy_(torch.arange(64) * 3 % tcfg.vocab_size - torch.arange(64))
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, tcfg.vocab_size, (tcfg.max_batch, 6), generator=gen)
    positions = torch.arange(6).expand(tcfg.max_batch, 6).contiguous()
    features = torch.zeros(tcfg.max_batch, 1, len(aux) * tcfg.dim)
    dcp.prepare(draft, group, "draft", max_batch=tcfg.max_batch, max_seq_len=tcfg.max_seq_len,
                example_inputs=(tokens[:, :1], positions[:, :1], features))
    draft_backend = dcp.backend(group, "draft", lowering="aot_eager")
    draft_c = torch.compile(draft, backend=draft_backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        logits, hidden = target_c(tokens, positions)
        ref_logits, ref_hidden = ref_target(tokens, positions)
        d_logits, d_hidden = draft_c(tokens, positions, hidden)
        r_logits, r_hidden = ref_draft(tokens, positions, ref_hidden)
        step = (tokens[:, :1], positions[:, -1:] + 1, d_hidden[:, -1:])
        s_logits, _ = draft_c(*step)
        rs_logits, _ = ref_draft(tokens[:, :1], positions[:, -1:] + 1, r_hidden[:, -1:])
    return dict(
        pairs=[(logits, ref_logits), (hidden, ref_hidden), (d_logits, r_logits), (s_logits, rs_logits)],
        hidden_width=hidden.shape[-1],
        draft_vocab=d_logits.shape[-1],
        target_ids=ref_draft.to_target_ids(torch.arange(d_logits.shape[-1])),
        draft_collectives=draft_backend.collective_counts,
        target_collectives=target_backend.collective_counts,
        draft_cache=tuple(draft.attention.k_cache.shape),
    )


SPEC_FIXTURES = {"eagle3": dict(noise=3.0), "eagle": dict(noise=2.5, seed=2),
                 "mla": dict(kind="eagle3", target="mla", noise=3.0),
                 "mqa": dict(kind="eagle3", noise=3.0, n_kv_heads=1)}


def spec_worker(rank, size, kind, k, temperature, max_new_tokens, step_graph=False, paging=None):
    """Speculative decoding of four prompts with the agreeing test pair on ``size`` ranks;
    ``step_graph``: each step as one graph (which runs without the per-step rank check);
    ``paging``: ``page_size`` and ``kv_tokens`` for the target's pool."""
    from dcp_compile.runtime.spec import SpecDecoder
    from tests.support import agreeing_pair

    group = dcp.init_group("cpu")
    fixture = dict(SPEC_FIXTURES[kind])
    target, draft = agreeing_pair(fixture.pop("kind", kind), **fixture)
    decoder = SpecDecoder(target, draft, group, k=k, max_batch=4, max_seq_len=96, temperature=temperature, seed=11,
                          lowering="aot_eager", check_ranks=not step_graph, step_graph=step_graph, **(paging or {}))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in (3, 9, 14, 20)]
    streamed = {i: [] for i in range(len(prompts))}
    outputs = dcp.generate_all(decoder, prompts, max_new_tokens, on_tokens=lambda i, new: streamed[i].extend(new))
    collectives = {
        name: b.collective_counts
        for name, b in (("target", decoder.target_backend), ("verify", decoder.verify_backend), ("draft", decoder.draft_backend))
    }
    from dcp_compile.passes.shard_attention import ALL_GATHER

    verify_all_gathers = [sum(n.target is ALL_GATHER for n in c.graph_module.graph.nodes) for c in decoder.verify_backend.compiled]
    return dict(
        verify_all_gathers=verify_all_gathers,
        tokens=[o.tokens for o in outputs], accepted=[o.accepted for o in outputs],
        finished=[o.finished_by for o in outputs], streamed=[streamed[i] for i in range(len(prompts))],
        collectives=collectives, draft_cache=tuple(draft.attention.k_cache.shape),
        commit_compiled=decoder.graphs.commit_c is not None, paged_graphs=_paged_graphs(decoder),
    )


def _paged_graphs(decoder) -> list[int]:
    """Per compiled target graph, its paged prefix attentions."""
    paged = (torch.ops.dcp.paged_prefix_attention.default, torch.ops.dcp.paged_latent_prefix_attention.default)
    return [sum(n.target in paged for n in c.graph_module.graph.nodes)
            for b in (decoder.target_backend, decoder.verify_backend) for c in b.compiled]


def diverging_spec_worker(rank, size):
    """Rank 1's draft weights differ from rank 0's: the per-step rank check must stop
    every rank with the same error instead of letting them drift into a hang."""
    from dcp_compile.runtime.spec import SpecDecoder
    from tests.support import agreeing_pair

    group = dcp.init_group("cpu")
    target, draft = agreeing_pair("eagle3", **SPEC_FIXTURES["eagle3"])
    if rank == 1:
        with torch.no_grad():
            draft.fc.weight.mul_(-1.0)
    decoder = SpecDecoder(target, draft, group, k=3, max_batch=4, max_seq_len=96, lowering="aot_eager",
                          check_ranks=True)
    from dcp_compile.group import ranks_that_differ

    checks = dict(
        nan_agrees=ranks_that_differ(group, torch.tensor([float("nan"), 1.0], dtype=torch.float64)),
        rank_differs=ranks_that_differ(group, torch.tensor([float(rank)])),
        error=None,
    )
    try:
        dcp.generate_all(decoder, [[1, 2, 3], [4, 5, 6, 7]], 20)
    except RuntimeError as err:
        checks["error"] = str(err)
    return checks


def chunked_parity_worker(rank, size, chunk_size, lengths, steps, interleave=1):
    """Greedy decoding with a chunked prefill on ``size`` ranks against the unsharded
    eager model fed each prompt whole."""
    from dcp_compile.runtime.generate import greedy_decode
    from tests.support import make_prompts

    group = dcp.init_group("cpu")
    cfg = LlamaConfig(max_batch=len(lengths))
    prompts = make_prompts(lengths)
    reference = greedy_decode(make_model(cfg), prompts, steps)
    model = make_model(cfg)
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len, interleave=interleave)
    backend = dcp.backend(group, "target", lowering="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    result = greedy_decode(compiled, prompts, steps, chunk_size=chunk_size, max_seq_len=cfg.max_seq_len)
    return dict(
        tokens=result.tokens, reference_tokens=reference.tokens,
        logits=torch.stack(result.logits), reference_logits=torch.stack(reference.logits),
        graphs=len(backend.compiled),
    )


def chunked_spec_worker(rank, size, chunk_size, lengths, temperature):
    """Speculative decoding with a chunked prefill of a ragged batch (the agreeing pair)."""
    from dcp_compile.runtime.spec import SpecDecoder
    from tests.support import agreeing_pair

    group = dcp.init_group("cpu")
    target, draft = agreeing_pair("eagle3", noise=3.0, max_batch=len(lengths), max_seq_len=96)
    decoder = SpecDecoder(target, draft, group, k=3, max_batch=len(lengths), max_seq_len=96, temperature=temperature,
                          seed=5, lowering="aot_eager", check_ranks=True, chunk_size=chunk_size)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in lengths]
    outputs = dcp.generate_all(decoder, prompts, 24)
    return dict(tokens=[o.tokens for o in outputs], accepted=[o.accepted for o in outputs],
                finished=[o.finished_by for o in outputs])


def _memory_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def long_prefill_memory_worker(rank, size, prompt_len, chunk_size):
    """Peak resident memory of a DCP prefill of one long prompt, after a warm-up call
    compiled the chunk graph.  The kernel's peak-RSS counter (reset through
    /proc/self/clear_refs) sees every allocation torch makes on the CPU."""
    from dcp_compile.runtime.generate import prefill_chunks

    group = dcp.init_group("cpu")
    cfg = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=prompt_len + 64, max_batch=1)
    model = make_model(cfg)
    dcp.prepare(model, group, "target", max_batch=1, max_seq_len=cfg.max_seq_len)
    compiled = torch.compile(model, backend=dcp.backend(group, "target", lowering="aot_eager"), fullgraph=True,
                             dynamic=False)
    prompt = torch.randint(1, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        warm = next(prefill_chunks([prompt[:chunk_size]], chunk_size, cfg.max_seq_len, "cpu"))
        compiled(warm.tokens, warm.positions)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current resident size
        before = _memory_kib("VmRSS")
        chunks = 0
        for chunk in prefill_chunks([prompt], chunk_size, cfg.max_seq_len, "cpu"):
            logits = compiled(chunk.tokens, chunk.positions)[0, chunk.last]
            chunks += 1
        peak = _memory_kib("VmHWM")
    return dict(peak_growth=(peak - before) * 1024, chunks=chunks, logits_finite=bool(torch.isfinite(logits).all()),
                heads=cfg.n_heads)


def refusal_worker(rank, size):
    """Every route around dcp.backend is refused before it writes; the right route then
    still answers as the unsharded model does."""
    from dcp_compile.runtime.generate import pad_prompts
    from tests.support import make_prompts

    group = dcp.init_group("cpu")
    cfg = LlamaConfig()
    model, reference = make_model(cfg), make_model(cfg)
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len)
    caches = [b for n, b in model.named_buffers() if "cache" in n]
    tokens, positions, _ = pad_prompts(make_prompts(), "cpu")
    routes = {
        "eager": lambda: model(tokens, positions),
        "aot_eager": lambda: torch.compile(model, backend="aot_eager", fullgraph=True)(tokens, positions),
        "inductor": lambda: torch.compile(model, fullgraph=True)(tokens, positions),
        "too many rows": lambda: torch.compile(model, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True)(
            torch.zeros(cfg.max_batch + 1, 2, dtype=torch.long), torch.arange(2).expand(cfg.max_batch + 1, 2)),
    }
    errors, untouched = {}, {}
    for name, call in routes.items():
        before = [c.clone() for c in caches]
        torch._dynamo.reset()
        try:
            with torch.no_grad():
                call()
            errors[name] = None
        except Exception as error:  # Dynamo wraps some of them
            errors[name] = str(error)
        untouched[name] = all(torch.equal(a, b) for a, b in zip(before, caches))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True, dynamic=False)
    with torch.no_grad():
        logits, ref_logits = compiled(tokens, positions), reference(tokens, positions)
    try:
        model.to(torch.float64)
        to_error = None
    except RuntimeError as error:
        to_error = str(error)
    return dict(errors=errors, untouched=untouched, logits=logits, reference_logits=ref_logits, to_error=to_error)


def engine_leader_worker(rank, size, prompts, arrivals, abort_at):
    """Leader mode: rank 0 takes ``prompts[i]`` at step ``arrivals[i]`` and aborts request
    0 at step ``abort_at``; the other ranks follow.  Then every rank decodes the same
    prompts as one static ``generate`` batch.  Returns each rank's tokens per request."""
    from dcp_compile.runtime.engine import SamplingParams, SpecEngine
    from tests.support import agreeing_pair

    group = dcp.init_group("cpu")
    target, draft = agreeing_pair("eagle3", noise=3.0, max_batch=2)
    # chunks of 4: the longer prompts prefill over several steps while the other row decodes
    decoder = dcp.SpecDecoder(target, draft, group, k=3, max_batch=2, max_seq_len=96, chunk_size=4, lowering="aot_eager")
    engine = SpecEngine(decoder, leader=True)
    tokens, ends = {}, {}
    if rank == 0:
        step = 0
        while step <= max(arrivals) or engine.has_work():
            for i, at in enumerate(arrivals):
                if at == step:
                    engine.add_request(prompts[i], SamplingParams(max_new_tokens=12))
            if step == abort_at:
                engine.abort(0)
            for rid, event in engine.step().items():
                tokens.setdefault(rid, []).extend(event.tokens)
                if event.finished_by:
                    ends[rid] = event.finished_by
            step += 1
        engine.shutdown()
    else:
        while not engine.stopped:
            for rid, event in engine.step().items():
                tokens.setdefault(rid, []).extend(event.tokens)
                if event.finished_by:
                    ends[rid] = event.finished_by
    static = [o.tokens for o in dcp.generate_all(decoder, prompts, 12)]
    return dict(tokens=tokens, ends=ends, static=static)


def mla_parity_worker(rank, size, interleave, decode_steps, form="einsum"):
    """The MLA reference target (absorbed latent attention, DeepSeek's decode form),
    prepared and compiled on ``size`` ranks, against itself eager and unsharded: a
    right-padded ragged prefill, then ``decode_steps`` steps at per-sequence positions."""
    from dcp_compile.models.llama import init_weights
    from dcp_compile.models.mla import MLAConfig, MLATransformer

    group = dcp.init_group("cpu")
    cfg = MLAConfig(max_seq_len=40, max_batch=3, q_lora_rank=12, attention_form=form)
    reference = init_weights(MLATransformer(cfg), 0, std=0.2).eval()
    model = init_weights(MLATransformer(cfg), 0, std=0.2).eval()
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len, interleave=interleave)
    backend = dcp.backend(group, lowering="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([4, 9, 13])
    prompt = torch.randint(0, cfg.vocab_size, (cfg.max_batch, 13), generator=gen)
    positions = torch.arange(13).expand(cfg.max_batch, 13).contiguous()
    outs, refs = [], []
    with torch.no_grad():
        outs.append(compiled(prompt, positions))
        refs.append(reference(prompt, positions))
        for step in range(decode_steps):
            tokens = torch.randint(0, cfg.vocab_size, (cfg.max_batch, 1), generator=gen)
            at = (lengths + step)[:, None]
            outs.append(compiled(tokens, at))
            refs.append(reference(tokens, at))
    caches = {name: tuple(b.shape) for name, b in model.named_buffers() if name.endswith("_cache")}
    return dict(outs=outs, refs=refs, caches=caches, collectives=backend.collective_counts)


def random_tree(n_nodes: int, max_depth: int, gen: torch.Generator):
    """``(parents, depth)`` of a random tree of ``n_nodes`` in topological order (node
    ``j``'s parent is -1, the root, or an earlier node), no deeper than ``max_depth``."""
    parents, depth = [], []
    for j in range(n_nodes):
        choices = [-1] + [i for i in range(j) if depth[i] < max_depth]
        parent = choices[int(torch.randint(len(choices), (), generator=gen))]
        parents.append(parent)
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return parents, depth


def path_to(node: int, parents: list[int]) -> list[int]:
    """The nodes from depth 1 down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_verify_commit_worker(rank, size, interleaves, rounds, seed):
    """``tree_verify_round_trip`` for each interleave, on one set of ranks."""
    return [tree_verify_round_trip(interleave, rounds, seed) for interleave in interleaves]


def tree_verify_round_trip(interleave, rounds, seed):
    """Prefill, then rounds of a tree verify (a random tree of ``N`` nodes under its
    ancestor mask) and the commit of a random root-to-node path, against the unsharded
    eager model fed each node's path as a sequence; a decode after the last commit reads
    the committed paths."""
    from dcp_compile.ops.tree_mask import TreeCall
    from dcp_compile.runtime.commit import KVCommit
    from dcp_compile.runtime.generate import pad_prompts
    from dcp_compile.runtime.tree import _ancestors
    from tests.support import make_prompts

    n_nodes, max_depth = 6, 3
    group = dcp.init_group("cpu")
    cfg = LlamaConfig()
    reference, model = make_model(cfg), make_model(cfg)
    dcp.prepare(model, group, "target", max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len, interleave=interleave,
                verify_tokens=n_nodes + 1, tree=True)
    decode = torch.compile(model, backend=dcp.backend(group, lowering="aot_eager"), fullgraph=True, dynamic=False)
    verify_backend = dcp.backend(group, verify=True, lowering="aot_eager")
    verify = torch.compile(TreeCall(model), backend=verify_backend, fullgraph=True, dynamic=False)
    commit = KVCommit(model)
    caches = [b for n, b in model.named_buffers() if "cache" in n]
    readable = caches[0].shape[2] - (n_nodes + 1)  # committed slots and the trash slot

    gen = torch.Generator().manual_seed(seed)
    B = cfg.max_batch
    tokens, positions, lengths = pad_prompts(make_prompts(), "cpu")
    outs, refs, untouched, paths = [], [], [], []
    with torch.no_grad():
        outs.append(decode(tokens, positions))
        refs.append(reference(tokens, positions))
        start = lengths.clone()
        for _ in range(rounds):
            parents, depth = random_tree(n_nodes, max_depth, gen)
            node_tokens = torch.randint(0, cfg.vocab_size, (B, n_nodes), generator=gen)
            verify_tokens = torch.cat([torch.randint(0, cfg.vocab_size, (B, 1), generator=gen), node_tokens], 1)
            verify_positions = start[:, None] + torch.tensor([0] + depth)
            ancestors = _ancestors(torch.tensor(parents).expand(B, n_nodes), max_depth)
            before = [c[:, :, :readable].clone() for c in caches]
            outs.append(verify(verify_tokens, verify_positions, ancestors))
            untouched.append(all(torch.equal(b, c[:, :, :readable]) for b, c in zip(before, caches)))
            # Each node's logits: the path root..node fed as a sequence from start.
            expected = torch.empty_like(outs[-1])
            for slot in range(n_nodes + 1):
                path = [0] + [j + 1 for j in path_to(slot - 1, parents)] if slot else [0]
                steps = torch.arange(len(path))
                expected[:, slot] = reference(verify_tokens[:, path], start[:, None] + steps)[:, -1]
            refs.append(expected)
            end = int(torch.randint(n_nodes + 1, (), generator=gen))  # accept root..end (0: the root alone)
            path = [0] + ([j + 1 for j in path_to(end - 1, parents)] if end else [])
            paths.append(path)
            slots = torch.tensor(path).expand(B, len(path)).contiguous()
            commit(start, torch.full((B,), len(path)), slots)
            reference(verify_tokens[:, path], start[:, None] + torch.arange(len(path)))  # the reference commits too
            start = start + len(path)
        token = torch.randint(0, cfg.vocab_size, (B, 1), generator=gen)
        outs.append(decode(token, start[:, None]))
        refs.append(reference(token, start[:, None]))
    graph = verify_backend.compiled[0].graph_module.code
    return dict(outs=outs, refs=refs, untouched=untouched, paths=paths, commit_needed=commit.needed, verify_graph=graph)


TREE_PROMPT_LENGTHS = (3, 9, 14, 20)
TREE_TEMPERATURES = (0.0, 0.0, 0.8, 0.8)
"""Two greedy rows and two sampled rows share every batch."""


def tree_spec_worker(rank, size, runs, max_new_tokens):
    """Speculative decoding of four prompts (``TREE_TEMPERATURES``) with the agreeing test
    pair, once per entry of ``runs`` (``SpecDecoder`` keyword arguments; ``k=0``: the
    target alone), on ``size`` ranks; fresh models and graphs for each."""
    from dcp_compile.runtime.engine import SamplingParams, SpecEngine
    from dcp_compile.runtime.spec import SpecDecoder
    from tests.support import agreeing_pair

    group = dcp.init_group("cpu")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32, (n,), generator=gen).tolist() for n in TREE_PROMPT_LENGTHS]
    results = []
    for run in runs:
        torch._dynamo.reset()
        target, draft = agreeing_pair("eagle3", noise=3.0)
        options = dict(max_batch=4, max_seq_len=96, seed=11, lowering="aot_eager", check_ranks=True) | run
        decoder = SpecDecoder(target, draft if run["k"] else None, group, **options)
        engine = SpecEngine(decoder)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens, temperature=t, seed=100 + i))
               for i, (p, t) in enumerate(zip(prompts, TREE_TEMPERATURES))]
        tokens, accepted = {i: [] for i in ids}, {i: [] for i in ids}
        while engine.has_work():
            for request, event in engine.step().items():
                tokens[request] += event.tokens
                accepted[request] += event.accepted
        results.append(dict(
            tokens=[tokens[i] for i in ids], accepted=[accepted[i] for i in ids], tree=decoder.tree_shape,
            draft_collectives=decoder.draft_backend.collective_counts if run["k"] else [],
            draft_cache=tuple(draft.attention.k_cache.shape), paged_graphs=_paged_graphs(decoder),
        ))
    return results
