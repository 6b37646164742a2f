"""Per-rank workers for the tensor-parallel tests: several TP x DCP cases in one world of
spawned ranks, so that the cases share the spawn and the process groups' setup."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import dcp_compile as dcp
from dcp_compile.group import tp_dcp_groups


@dataclass(frozen=True)
class Case:
    tp: int
    dcp: int | tuple[int, ...]
    """One DCP size for every replica of the world, or one per replica."""
    kind: str = "eagle3"
    """``SPEC_FIXTURES`` key: the agreeing pair's target (``"mla"``: latent attention)."""
    temperature: float = 0.0
    topk: int = 1
    draft_tokens: int | None = None
    comm: str = "ag"
    max_new_tokens: int = 24

    @property
    def name(self) -> str:
        dcp = "-".join(map(str, self.dcp)) if isinstance(self.dcp, tuple) else self.dcp
        return f"tp{self.tp}-dcp{dcp}-{self.kind}-t{self.temperature}-topk{self.topk}-{self.comm}"


K = 4
PROMPT_LENGTHS = (3, 9, 14, 20)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def decode(case: Case, group, *, shard: bool = True) -> dict:
    """Speculative decoding of the four prompts with the agreeing test pair, the target
    tensor-parallel over ``group`` (unless ``shard`` is off: the one-rank reference)."""
    from tests.runtime.workers import SPEC_FIXTURES
    from tests.support import agreeing_pair

    fixture = dict(SPEC_FIXTURES[case.kind])
    target, draft = agreeing_pair(fixture.pop("kind", case.kind), **fixture)
    draft_weights = {n: p.clone() for n, p in draft.named_parameters()}
    if shard:
        dcp.tensor_parallel(target, group)
    decoder = dcp.SpecDecoder(target, draft, group, k=K, max_batch=4, max_seq_len=96, topk=case.topk,
                              draft_tokens=case.draft_tokens, temperature=case.temperature, seed=11,
                              lowering="aot_eager", comm=case.comm, check_ranks=True)
    outputs = dcp.generate_all(decoder, prompts(), case.max_new_tokens)
    verify = decoder.verify_backend.compiled
    return dict(
        tokens=[o.tokens for o in outputs], accepted=[o.accepted for o in outputs],
        target_cache=tuple(_first_cache(target).shape), draft_cache=tuple(draft.attention.k_cache.shape),
        draft_unchanged=all(torch.equal(p, draft_weights[n]) for n, p in draft.named_parameters()),
        draft_collectives=decoder.draft_backend.collective_counts,
        verify_collectives=[collective_names(c.graph_module) for c in verify],
    )


def _first_cache(model) -> torch.Tensor:
    attention = model.layers[0].attention
    return attention.k_cache if hasattr(attention, "k_cache") else attention.kv_cache


def collective_names(gm) -> dict[str, int]:
    """The collectives of a compiled graph, by op name (``all_gather_into_tensor``, ...)."""
    from dcp_compile.passes.check import is_collective

    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if is_collective(node):
            name = str(node.target).split(".")[1]
            counts[name] = counts.get(name, 0) + 1
    return counts


def _refusal_at_prepare(world: int) -> str | None:
    """A DCP group of 4 over a target whose 2 KV heads TP put on different ranks (sharded
    without ``tensor_parallel``'s check): ``prepare`` must refuse it on every rank."""
    from dcp_compile.models.parallel import shard_in_place
    from tests.support import agreeing_pair

    group = tp_dcp_groups([list(range(world))], world, torch.device("cpu"))
    target, _ = agreeing_pair("eagle3", noise=3.0)
    shard_in_place(target, group.tp_size, group.tp_rank, group.tp_group_name)
    try:
        dcp.prepare(target, group, "target", max_batch=4, max_seq_len=96)
    except ValueError as error:
        return str(error)
    return None


def tp_cases_worker(rank: int, world: int, cases: list[Case]) -> dict:
    """Run every case on this world: a case of TP size T runs as world / T replicas of
    contiguous ranks, each replica a TP group with its DCP blocks.  Then the refusal of a
    DCP group over different KV heads."""
    dcp.init_group("cpu")
    device = torch.device("cpu")
    results = []
    for case in cases:
        replicas = [list(range(start, start + case.tp)) for start in range(0, world, case.tp)]
        group = tp_dcp_groups(replicas, list(case.dcp) if isinstance(case.dcp, tuple) else case.dcp, device)
        torch._dynamo.reset()  # each case's models are new: their graphs must not count as recompiles of the last's
        results.append(dict(decode(case, group), tp_rank=group.tp_rank, dcp_rank=group.rank))
    return dict(cases=results, refusal=_refusal_at_prepare(world))


def reference(case: Case) -> dict:
    """One rank running the unsharded model: the off arm every case is compared with."""
    return decode(case, dcp.init_group("cpu"), shard=False)
