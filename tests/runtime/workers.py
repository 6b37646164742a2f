"""Per-rank functions for the multi-rank runtime tests (importable by spawned ranks)."""

import torch

import dcp_compile as dcp
from dcp_compile.models import LlamaConfig
from dcp_compile.passes.check import is_collective
from dcp_compile.testing import make_model
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
        draft_collectives=sum(is_collective(n) for c in draft_backend.compiled for n in c.graph_module.graph.nodes),
        draft_graphs=len(draft_backend.compiled),
        draft_equal=torch.equal(draft_out, draft_ref),
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
