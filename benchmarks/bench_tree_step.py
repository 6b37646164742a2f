"""A speculative step with a draft tree against the chain, at long context: where the time
goes and what each shape is expected to decode per second.

    python3 benchmarks/bench_tree_step.py --out $OUT/tree_step.json        # one GPU, 8B-shaped target
    python3 benchmarks/bench_tree_step.py --small --device cpu             # the script itself, on CPU

One GPU (a group of one), ``SpecDecoder(cuda_graphs=True)``: a Llama-3-8B-shaped target
(``--layers`` of its 32, vocabulary 128,256, random weights, bf16) and an EAGLE3 draft
(draft vocabulary 32,768).  For every batch, shape ``k,topk,draft_tokens`` and context:

- the rows' caches hold random K/V and every row's root sits at the context, so each
  step reads the context once per layer whatever the weights accept; the step then
  repeats from the same state (its writes land past the context);
- **step**: median milliseconds of ``DeviceStep.step``, CUDA events around it, the whole
  step in one graph (``runtime.step_graph``): the draft's depths and the tree's
  construction between them, the verify, the acceptance, the commit and the
  draft-extend; **step, calls**: the same with each call captured on its own and the
  glue between them run from the host (``step_graph`` set aside);
- **verify** and **draft** (the extend and every draft step or tree depth): the captured
  graphs alone, replayed back to back;
- **tokens/s** expected: ``batch * accept length / step``, the accept length given per
  shape (``--accept``, from the tables in BENCHMARKS.md).

Every shape runs through the tree's graphs (``SpecDecoder(tree=True)``), the chain too:
on a group of one that is the cascade a DCP group runs (prefix over the cache, window,
merge), where a chain's plain off arm would attend over the whole cache's capacity.  Use
``--lowering inductor`` on a GPU: under ``aot_eager`` every KV write is functionalized
into a copy of the whole cache, which then dominates the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

import torch

import dcp_compile as dcp
from dcp_compile.models import DraftConfig, EagleDraft, Llama, LlamaConfig
from dcp_compile.models.llama import llama3_8b_shape
from dcp_compile.runtime.sampling import Noise
from dcp_compile.runtime.state import StepState
from _report import leave, log, median_ms, parse_with_watchdog, randomize, report

SMALL = LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                    aux_layers=(0, 1, 2))


def parse_shape(text: str) -> tuple[int, int, int]:
    k, topk, nodes = (int(x) for x in text.split(","))
    return k, topk, nodes


def build(cfg, shape, device, lowering: str):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    target = randomize(Llama(cfg, dtype=dtype, device=device, cache_device="meta")).eval()
    dcfg = DraftConfig(cfg, "eagle3", draft_vocab_size=min(32768, cfg.vocab_size))
    draft = randomize(EagleDraft(dcfg, dtype=dtype, device=device, cache_device="meta")).eval()
    k, topk, nodes = shape
    decoder = dcp.SpecDecoder(target, draft, dcp.DCPGroup(1, 0, device, None), k=k, topk=topk, draft_tokens=nodes,
                              tree=True, max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len,
                              cuda_graphs=device.type == "cuda", lowering=lowering)
    with torch.no_grad():
        for name, buffer in list(target.named_buffers()) + list(draft.named_buffers()):
            if name.endswith("_cache"):
                buffer.normal_()  # timing must not read zeros
    return decoder, target, draft


def state_at(context: int, decoder, target, draft, device) -> StepState:
    B = decoder.max_batch
    hidden = torch.randn(B, 1, draft.cfg.shapes.dim, device=device, dtype=draft.dtype)
    return StepState(
        length=torch.full((B,), context, device=device), current=torch.randint(0, target.vocab_size, (B,), device=device),
        q_logits=torch.randn(B, draft.head.out_features, device=device), hidden=hidden,
        active=torch.ones(B, dtype=torch.bool, device=device), temperature=torch.zeros(B, device=device),
        sampling=False, remaining=torch.zeros(B, dtype=torch.long, device=device),
        stops=torch.full((B, 1), -1, dtype=torch.long, device=device),
    )


def timed_step(decoder, state, noise) -> None:
    """One step from the same context: a budget of 0 ends every row where it stands, and
    each step starts them again (one small fill)."""
    state.active.fill_(True)
    decoder.device_step.step(state, noise)


def graph_ms(decoder, reps: int) -> dict:
    """Each captured graph's replay: the verify, and the draft's (extend, steps or depths)."""
    g = decoder.graphs
    (verify,) = [median_ms(c.graph.replay, reps) for c in g.target_verify.graphs.values()]
    drafts = [median_ms(c.graph.replay, reps) for c in g.draft_step.graphs.values()]
    if g.draft_tree is not None:  # one graph per depth after the first
        drafts += [median_ms(c.graph.replay, reps) for depth in g.draft_tree for c in depth.graphs.values()]
    else:  # the extend, and the chain's step replayed k - 1 times
        by_width = {sig[0][0][1]: median_ms(c.graph.replay, reps) for sig, c in g.draft_step.graphs.items()}
        drafts = [by_width[max(by_width)]] + [by_width.get(1, 0.0)] * (decoder.k - 1)
    commit = [median_ms(c.graph.replay, reps) for c in g.commit_c.graphs.values()] if g.commit_c is not None else [0.0]
    return dict(verify=verify, draft=sum(drafts), commit=commit[0])


def measure(batch: int, shape, contexts, args, device) -> list[dict]:
    base = SMALL if args.small else dataclasses.replace(llama3_8b_shape(), n_layers=args.layers,
                                                        aux_layers=(1, args.layers // 2, args.layers - 2))
    k, topk, nodes = shape
    cfg = dataclasses.replace(base, max_batch=batch, max_seq_len=max(contexts) + 2 * (k + 1))
    log(f"batch {batch}, shape {shape}: building (max_seq_len {cfg.max_seq_len})")
    decoder, target, draft = build(cfg, shape, device, args.lowering)
    noise = Noise(device, 0)
    rows = []
    cuda = device.type == "cuda"
    with torch.no_grad():
        for context in contexts:
            state = state_at(context, decoder, target, draft, device)
            whole = decoder.device_step.step_graph
            step = median_ms(lambda: timed_step(decoder, state, noise), args.reps, warmup=3, cuda=cuda)
            decoder.device_step.step_graph = None  # the calls arm: each call's graph, the glue uncaptured
            calls = median_ms(lambda: timed_step(decoder, state, noise), args.reps, warmup=3, cuda=cuda)
            decoder.device_step.step_graph = whole
            row = dict(batch=batch, k=k, topk=topk, draft_tokens=nodes, context=context, layers=cfg.n_layers,
                       step_ms=step, step_calls_ms=calls)
            if cuda:
                row.update({f"{name}_ms": ms for name, ms in graph_ms(decoder, args.reps).items()})
            accept = args.accept.get(shape)
            if accept is not None:
                row["accept_length"] = accept
                row["tokens_per_s"] = batch * accept / (step / 1e3)
            log(f"  {row}")
            rows.append(row)
    del decoder, target, draft
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    print("| batch | context | k,topk,nodes | verify ms | draft ms | step ms | step, calls ms | accept | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["batch"], r["context"], f"{r['k']},{r['topk']},{r['draft_tokens']}",
                 f"{r.get('verify_ms', float('nan')):.3f}", f"{r.get('draft_ms', float('nan')):.3f}",
                 f"{r['step_ms']:.3f}", f"{r['step_calls_ms']:.3f}", r.get("accept_length", "-"),
                 f"{r.get('tokens_per_s', float('nan')):.0f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--max-context", type=str, nargs="*", default=[],
                        help="BATCH:CONTEXT, the longest context a batch runs (memory)")
    parser.add_argument("--shapes", nargs="+", default=["3,1,3", "6,1,6", "6,4,16", "6,4,32", "6,4,64"],
                        help="k,topk,draft_tokens; topk 1 with draft_tokens k is the chain")
    parser.add_argument("--accept", nargs="*", default=[], help="k,topk,draft_tokens=ACCEPT_LENGTH")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--lowering", default="inductor", choices=["aot_eager", "inductor"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a 2-layer model (to check the script)")
    parser.add_argument("--out")
    args = parse_with_watchdog(parser)
    args.accept = {parse_shape(a.split("=")[0]): float(a.split("=")[1]) for a in args.accept}
    limits = {int(b): int(c) for b, c in (m.split(":") for m in args.max_context)}
    device = torch.device(args.device)
    rows = []
    for batch in args.batches:
        contexts = [c for c in args.contexts if c <= limits.get(batch, max(args.contexts))]
        for text in args.shapes:
            rows += measure(batch, parse_shape(text), contexts, args, device)
    print_table(rows)
    report(dict(rows=rows, lowering=args.lowering, torch=torch.__version__,
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu"), args.out)
    leave()


if __name__ == "__main__":
    main()
