"""The torch.compile backend: run the pass pipeline for a fixed role, then lower.

``backend(group, role)`` returns a callable for ``torch.compile(..., backend=...)``.
The role and the group are bound when the backend is made, so a compiled graph is
sharded (target) or whole (draft) for its whole life; nothing is switched at run time.

- target, group of N > 1: find -> shard_kv_writes -> shard_attention -> check_target;
- draft: find -> shard_attention on a group of one (the prefix + window cascade with
  no collective, so attention costs the sequence's length, not the cache's capacity)
  -> check_draft (writes untouched, no collective); a draft attention whose mask the
  passes cannot prove causal is left as written, which is correct for a whole cache;
- target, group of size 1: no rewrite at all, so the result is exactly what plain
  ``torch.compile`` of the unmodified model gives (the off arm); except a tree verify
  (``ops.tree_mask``), which on any group stages its writes and runs the cascade with
  the tree's mask, since the model's own mask cannot tell siblings from ancestors.

Then Inductor (``compile_fx``: Triton on GPU, C++ on CPU), or ``aot_eager`` for fast
CPU tests of the passes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import time

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.fx import GraphModule

from dcp_compile.ops.guard import strip_backend_guards
from dcp_compile.ops.inlining import KERNELS, lowering_kernels
from dcp_compile.ops.tree_mask import TreeMarks, strip_tree_positions
from dcp_compile.passes import draft_passes, find, run_passes, target_passes
from dcp_compile.passes.check import count_collectives
from dcp_compile.passes.find import Plan
from dcp_compile.passes.page_caches import extra_inputs, page_caches, static_fakes
from dcp_compile.passes.pipeline import PassTiming
from dcp_compile.passes.shard_attention import COMMS, TreeSlots
from dcp_compile.passes.fx_utils import GraphPatternError, shape_of, where
from dcp_compile.records import ROLES, CacheRecord, PagedKV, is_checked_table, paged_for, record_for
from dcp_compile.group import DCPGroup

LOWERINGS = ("inductor", "aot_eager")


@dataclass
class CompiledGraph:
    """One graph this backend compiled: the graph as lowered, what the passes saw, and
    where the backend's time went."""

    graph_module: GraphModule
    plan: Plan
    timings: list[PassTiming]
    analysis_seconds: float = 0.0
    """Finding the caches and attention sites (``find``) and checking them."""
    lowering_seconds: float = 0.0
    """Inductor (or AOT autograd) on the rewritten graph, until it returned a callable."""


@dataclass
class Backend:
    """A torch.compile backend bound to one DCP group and one role.

    A copy (``copy.deepcopy``, as Hugging Face does with a ``CompileConfig``) is the same
    backend: it is bound to a live process group, which is a handle, not a value."""

    def __deepcopy__(self, memo):
        return self

    group: DCPGroup
    role: str = "target"
    lowering: str = "inductor"
    """``"inductor"`` (the real path) or ``"aot_eager"`` (no codegen; fast CPU tests)."""
    verify: bool = False
    """Target verify graphs: the new tokens' K/V wait in staging slots for
    ``KVCommit`` instead of going to their owners (needs ``prepare(verify_tokens=...)``).
    A group of size 1 writes in place, as plain ``torch.compile`` does."""
    comm: str = "ag"
    """How the ranks' partial attentions meet: ``"ag"`` (one all-gather per layer) or
    ``"a2a"`` (all-to-all by head group, local merge, all-gather of merged heads).  Inside
    TP, after the all-gather of the peers' queries: ``"a2a"`` hands each rank its heads'
    partials (``(D-1)/D`` of the payload a rank), ``"ag"`` all-gathers every rank's
    partials and each keeps its block (``D-1`` times the payload)."""
    cascade: bool = False
    """Rewrite attention into the prefix + window + merge cascade even for a group of
    one (no collective): the single-GPU baseline with the same kernels, for measuring
    DCP like for like.  Off by default: a size-1 group compiles as plain torch.compile."""
    check_positions: bool = True
    """Check before each call that positions lie in ``[0, max_seq_len)``; costs one
    device-to-host sync per call on GPU, so a call captured in a CUDA graph is refused
    (with the fix) unless this is off."""
    kernels: str = "inline"
    """``"inline"``: Inductor emits the attention ops' Triton kernels in its own code;
    ``"opaque"``: each op stays one call Inductor leaves alone, which compiles faster
    (``ops.inlining``).  Inductor lowering only; a CPU graph keeps its ops opaque either way."""
    dump_dir: Path | None = None
    """Write each graph's code before and after every pass here."""
    compiled: list[CompiledGraph] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.lowering not in LOWERINGS:
            raise ValueError(f"lowering must be one of {LOWERINGS}, got {self.lowering!r}")
        if self.comm not in COMMS:
            raise ValueError(f"comm must be one of {COMMS}, got {self.comm!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")

    @property
    def collective_counts(self) -> list[int]:
        """Collectives in each graph compiled so far (0 for drafts, 2 per layer for targets:
        the all-gather and its wait)."""
        return [count_collectives(c.graph_module) for c in self.compiled]

    def _records(self, plan: Plan, example_inputs: Sequence) -> list[CacheRecord]:
        records = []
        for cache in plan.caches:
            record = record_for(example_inputs[cache.input_index])
            if record is None:
                raise ValueError(
                    f"{self.role} graph writes KV cache {cache.name}, which dcp.prepare has not seen: call "
                    f"dcp.prepare(model, group, role={self.role!r}, max_batch=..., max_seq_len=...) before "
                    f"torch.compile"
                )
            if record.role != self.role:
                raise ValueError(
                    f"KV cache {record.name} was prepared with role={record.role!r} but is compiled with "
                    f"dcp.backend(group, role={self.role!r}); use the same role for prepare and backend"
                )
            expected_size = self.group.size if self.role == "target" else 1
            if record.layout.size != expected_size:
                raise ValueError(
                    f"KV cache {record.name} was prepared for a group of {record.layout.size} ranks, but this "
                    f"backend's group has {self.group.size}; prepare and compile with the same group"
                )
            records.append(record)
        return records

    def __call__(self, gm: GraphModule, example_inputs: Sequence, **_):
        symbolic = [n.name for n in gm.graph.nodes if n.op == "placeholder" and _is_symbolic(n.meta.get("example_value"))]
        if symbolic:
            raise ValueError(
                f"dcp.backend compiles static shapes, but Dynamo traced graph inputs {symbolic[:4]} with symbolic sizes "
                f"(it does so on a second call of another shape when dynamic is left unset): the KV layout and the "
                f"mask proofs need every size. Compile with torch.compile(model, backend=dcp.backend(...), "
                f"fullgraph=True, dynamic=False); each new shape then compiles its own graph (prefill in chunks of "
                f"one size to keep that to one graph)"
            )
        started = time.perf_counter()
        if any(isinstance(t, torch.Tensor) and paged_for(t) is not None for t in example_inputs):
            gm = _own_copy(gm)  # paging adds graph inputs, which Dynamo's own graph must not see
        guards = strip_backend_guards(gm)
        marks = strip_tree_positions(gm)
        plan = find(gm)
        if not plan.caches and (guards or not any(n.op.startswith("call") for n in gm.graph.nodes)):
            # Dynamo may compile a prepared model's forward pre-hook as a frame of its
            # own: its graph only marks the inputs (which this backend lets through),
            # or holds nothing at all.
            return gm
        records = self._records(plan, example_inputs)
        if self.role == "target" and not plan.sites:
            raise ValueError(
                "the target graph holds no attention over a KV cache: nothing to shard. Compile the model "
                "dcp.prepare was called on, with caches written and read by F.scaled_dot_product_attention"
            )
        if self.role == "target" and torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
        ):
            raise ValueError(
                "dcp-compile compiles inference graphs; call the compiled target under torch.no_grad() or "
                "torch.inference_mode()"
            )
        if self.role == "target" and self.group.size > 1:
            self._check_sharded_inputs(gm, plan, example_inputs)
        tag = f"{self.role}_r{self.group.rank}_g{len(self.compiled)}"
        paged = _paged_caches(plan, example_inputs)
        passes = self._passes(plan, records, marks, paged_cascade=bool(paged))
        extras = extra_inputs(paged) if paged else []
        if paged:
            passes.append(functools.partial(page_caches, paged=paged))
            example_inputs = [*example_inputs, *static_fakes(extras)]
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
        analysis = time.perf_counter() - started
        gm, timings = run_passes(gm, plan, passes, dump_dir=self.dump_dir, tag=tag)
        record = CompiledGraph(gm, plan, timings, analysis_seconds=analysis)
        self.compiled.append(record)
        started = time.perf_counter()
        compiled = self._lower(gm, example_inputs)
        record.lowering_seconds = time.perf_counter() - started
        if paged:
            compiled = _with_inputs(compiled, extras)
        return self._guard_positions(compiled, plan, records)

    def compile_seconds(self) -> dict[str, float]:
        """Where this backend's compile time went, summed over its graphs: ``analysis``
        (finding and checking the sites), ``passes`` (the rewrites) and ``lowering``
        (Inductor or AOT autograd).  Dynamo's tracing comes before the backend and is
        not in it."""
        return dict(analysis=sum(g.analysis_seconds for g in self.compiled),
                    passes=sum(t.seconds for g in self.compiled for t in g.timings),
                    lowering=sum(g.lowering_seconds for g in self.compiled), graphs=len(self.compiled))

    def _passes(self, plan: Plan, records: list[CacheRecord], marks: TreeMarks | None, paged_cascade: bool = False
                ) -> list:
        """The passes for this graph's role; ``marks``: its tree mask (and, for a tree
        draft's depth, the draft cache's length), if any.  ``paged_cascade``: the caches
        are paged, so even a group of one rewrites its attention (to read the pages)."""
        ancestors = None if marks is None else marks.ancestors
        if self.role == "draft":
            proven = plan.sites and records and all(site.mask.proven for site in plan.sites)
            if ancestors is not None and not proven:
                raise GraphPatternError(
                    "a tree draft step needs the draft's attention in the form the passes prove position-causal, "
                    "so that its window can take the tree mask; this draft's is not (or it writes no KV cache)"
                )
            slots = None if marks is None or marks.cached is None else self._tree_slots(plan, records, marks)
            return draft_passes(records[0].layout if proven else None, ancestors, slots)
        if marks is not None and marks.cached is not None:
            raise ValueError("a staged tree call (TreeCall(model, staged=True)) is a draft's depth: compile it with "
                             "dcp.backend(group, 'draft')")
        staged = self.verify and records[0].sharded
        if ancestors is not None and not staged:
            raise ValueError(
                "a tree verify graph needs dcp.backend(group, 'target', verify=True) and a target prepared with "
                "dcp.prepare(..., verify_tokens=draft_tokens + 1, tree=True): its siblings share positions, so "
                "their K/V must wait in staging slots for the commit of the accepted path"
            )
        if self.group.size > 1 or staged:
            group_name = self.group.group_name if self.group.size > 1 else None
            return target_passes(records[0].layout, group_name, self._staging_first_slot(plan, records), self.comm,
                                 ancestors, heads_split=self.group.heads_split)
        if self.cascade or paged_cascade:
            return target_passes(records[0].layout, None)
        return []

    def _check_sharded_inputs(self, gm: GraphModule, plan: Plan, example_inputs: Sequence) -> None:
        """Sharded tensors may enter a target graph only where the passes rewrite their use."""
        written = {c.input_index for c in plan.caches}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for index, tensor in enumerate(example_inputs):
            record = record_for(tensor) if isinstance(tensor, torch.Tensor) else None
            if record is not None and record.sharded and index not in written and placeholders[index].users:
                user = next(iter(placeholders[index].users))
                raise GraphPatternError(
                    f"KV cache {record.name} holds only this rank's shard but this graph reads it at {where(user)} "
                    f"without writing it, so the passes cannot tell which positions it holds (attention over a "
                    f"cache written elsewhere, such as cross-attention, is not supported under DCP)"
                )
        for index in plan.mask_inputs:
            if not is_checked_table(example_inputs[index]):
                raise ValueError(
                    f"graph input {index} is a causal-mask table over the sharded KV cache that dcp.prepare did not "
                    f"check and shard; prepare the model with example inputs that exercise the same mask"
                )

    def _tree_slots(self, plan: Plan, records: list[CacheRecord], marks: TreeMarks) -> TreeSlots:
        """Where a tree draft's depth keeps its nodes: after the ``S`` nodes its mask
        ``[B, T, S + T]`` says the earlier depths left in the tree slots."""
        tokens = max(w.index.tokens for w in plan.writes)
        width = shape_of(marks.ancestors)[-1]
        reserved = min(r.tree_slots for r in records)
        if width < tokens or width > reserved:
            raise ValueError(
                f"this tree draft depth brings {tokens} new tokens under a mask over {width} keys (the nodes of the "
                f"earlier depths, then its own), but prepare reserved tree_slots={reserved} in the draft's cache: "
                f"call dcp.prepare(draft, ..., tree_slots={max(width, tokens)}) or more ((k - 1) * topk for a tree)"
            )
        return TreeSlots(records[0].layout.max_seq_len, width - tokens, marks.cached)

    def _staging_first_slot(self, plan: Plan, records: list[CacheRecord]) -> int | None:
        if not self.verify:
            return None
        tokens = max(w.index.tokens for w in plan.writes)
        reserved = min(r.verify_tokens for r in records)
        if tokens > reserved:
            raise ValueError(
                f"this verify graph brings {tokens} new tokens per sequence but prepare reserved "
                f"verify_tokens={reserved} staging slots; call dcp.prepare(..., verify_tokens={tokens}) or more"
            )
        return records[0].layout.local_cache_len

    def _lower(self, gm: GraphModule, example_inputs: Sequence):
        if self.lowering == "inductor":
            from torch._inductor.compile_fx import compile_fx

            with rank_identical_kernels(self.group.replica_size), lowering_kernels(self.kernels), cacheable_helpers(gm):
                return compile_fx(gm, example_inputs)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def _guard_positions(self, compiled, plan: Plan, records: list[CacheRecord]):
        if not self.check_positions or not plan.position_inputs or not records:
            return compiled
        max_seq_len = records[0].layout.max_seq_len
        sources = plan.position_inputs

        def check(args) -> None:
            for i, reach in sources:
                positions = args[i]
                if not positions.numel():
                    continue
                if positions.is_cuda and torch.cuda.is_current_stream_capturing():
                    # Refused before the host read, which would abort the capture with
                    # CUDA's "operation not permitted when stream is capturing".
                    raise RuntimeError(
                        "this compiled call is being captured in a CUDA graph, but the backend checks its positions "
                        "against max_seq_len on the host before every call, which a capture cannot do: build the "
                        "backend with check_positions=False for graphs you capture, and keep every position in "
                        f"[0, max_seq_len={max_seq_len}) yourself (stop each sequence before it reaches the cache's end)"
                    )
                low, high = int(positions.min()), int(positions.max()) + reach
                if low < 0 or high >= max_seq_len:
                    raise ValueError(
                        f"positions must lie in [0, max_seq_len={max_seq_len}), got values in [{low}, {high}]: "
                        f"the KV cache has no slot for them. Stop the sequence before it reaches max_seq_len, "
                        f"or prepare with a larger max_seq_len (a Hugging Face DCPStaticCache: a larger "
                        f"max_cache_len, or cache.reset() between requests)"
                    )

        def run(*args):
            check(args)
            return compiled(*args)

        return run


def _paged_caches(plan: Plan, example_inputs: Sequence) -> dict[int, PagedKV]:
    """The graph input index and pages of each cache ``prepare`` paged; all of them or none."""
    paged = {c.input_index: paged_for(example_inputs[c.input_index]) for c in plan.caches}
    if any(p is None for p in paged.values()) and any(p is not None for p in paged.values()):
        raise ValueError("this graph writes paged and unpaged KV caches; prepare each model with one page_size")
    return {i: p for i, p in paged.items() if p is not None}


def _own_copy(gm: GraphModule) -> GraphModule:
    """A copy of Dynamo's graph for the passes to change at will, with what AOT autograd
    reads of Dynamo's (each input's source, the compile id)."""
    graph = copy.deepcopy(gm.graph)
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), graph.find_nodes(op="placeholder")):
        new._dynamo_source = getattr(old, "_dynamo_source", None)
    copied = GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copied._param_name_to_source = gm._param_name_to_source
    return copied


def _with_inputs(compiled, extra: list[torch.Tensor]):
    """``compiled`` called with the pages after the graph's own inputs: the same tensors
    every call, so a CUDA graph capture sees fixed addresses."""

    def run(*args):
        return compiled(*args, *extra)

    return run


def _is_symbolic(value) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape)


def cacheable_helpers(gm: GraphModule):
    """Let AOTAutograd's cache keep a rewritten graph across processes.

    The passes call this package's helpers (``ops.cascade``) from the graphs they build,
    and AOTAutograd caches only graphs whose every function it knows, so without this a
    restart traces each rewritten graph again.  Each helper is marked cacheable under a
    key of the package's source: another version of the package never reuses an entry."""
    import torch._inductor.config as inductor_config

    names = {f"{n.target.__module__}.{n.target.__name__}" for n in gm.graph.nodes
             if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("dcp_compile.")}
    if not names or not isinstance(getattr(inductor_config, "unsafe_marked_cacheable_functions", None), dict):
        return contextlib.nullcontext()  # a torch without the setting traces these graphs on every restart
    marked = dict(inductor_config.unsafe_marked_cacheable_functions)
    # Sorted: the config is part of the cache key, and a set's order changes between processes.
    marked.update(dict.fromkeys(sorted(names), _package_source_key()))
    return inductor_config.patch(unsafe_marked_cacheable_functions=marked)


@functools.cache
def _package_source_key() -> str:
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def rank_identical_kernels(group_size: int):
    """Inductor settings under which every rank compiles the same kernels.

    Every rank of a group computes the replicated part of a step (the merge, the
    projections, the MLP, the whole draft) on its own, and the ranks must agree bitwise
    or they accept different tokens and then deadlock in mismatched collectives.  By
    default Inductor picks among reduction configs by timing them on the device at the
    first call, and timing noise can make ranks pick configs that sum in different
    orders.  Its deterministic mode picks without timing.  Groups of one keep the defaults.
    """
    import torch._inductor.config as inductor_config

    if group_size == 1:
        return contextlib.nullcontext()
    if not hasattr(inductor_config, "deterministic"):
        raise RuntimeError(
            f"torch {torch.__version__} has no torch._inductor.config.deterministic, which DCP groups of more than "
            f"one rank need so that every rank compiles the same kernels; use torch >= 2.11 or lowering='aot_eager'"
        )
    return inductor_config.patch(deterministic=True)


def backend(
    group: DCPGroup,
    role: str = "target",
    *,
    verify: bool = False,
    lowering: str = "inductor",
    comm: str = "ag",
    cascade: bool = False,
    check_positions: bool = True,
    kernels: str = "inline",
    dump_dir: str | Path | None = None,
) -> Backend:
    """A torch.compile backend for ``role`` (``"target"`` or ``"draft"``) on ``group``."""
    if verify and role != "target":
        raise ValueError("verify=True applies to target graphs; draft graphs are never sharded")
    if cascade and role != "target":
        raise ValueError("cascade=True applies to target graphs; draft graphs are never rewritten")
    return Backend(
        group, role, lowering, verify, comm, cascade, check_positions, kernels,
        dump_dir=Path(dump_dir) if dump_dir is not None else None,
    )
