"""Train the shipped pair: a byte-level Llama on the Python standard library, then its
EAGLE3 draft on the target's hidden states and output distributions.

    dcp-compile train --device cuda --out runs/tiny-code      # minutes on one H200
    dcp-compile train --preset smoke --out /tmp/smoke          # seconds, for tests

**Data.** Every ``.py`` file of the running interpreter's standard library
(``site-packages`` and caches excluded), read as bytes.  A file is held out for
evaluation when ``crc32(relative path) % 20 == 0`` (about 5%): the same rule on every
machine, whatever order the files are listed in.  Files are joined with a NUL byte,
which never occurs in Python source, so it marks document boundaries.

**Target.** Next-byte cross-entropy on random windows, AdamW, linear warm-up then
cosine decay; bf16 autocast on CUDA.

**Draft (EAGLE3).** The target is frozen.  On each window the target yields its
auxiliary hidden states (the ``fc`` input) and its logits; the draft is unrolled
``ttt_steps`` times with its own hidden states fed back
(``EagleDraft.forward_unrolled``, "training-time test"), and every step is trained on
the target's distribution for the token it proposes (soft cross-entropy), step ``j``
weighted ``0.8 ** j`` as the EAGLE3 recipe does.  The draft shares the target's
token embedding, frozen.
"""

from __future__ import annotations

import json
import math
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F

from dcp_compile.models import DraftConfig, EagleDraft, Llama, LlamaConfig, eagle3_aux_layers

DOCUMENT_SEPARATOR = 0
HELD_OUT_MODULUS = 20


@dataclass(frozen=True)
class TrainConfig:
    dim: int = 256
    n_layers: int = 8
    n_heads: int = 4
    n_kv_heads: int = 2
    intermediate_size: int = 768
    seq_len: int = 512
    batch: int = 64
    target_steps: int = 3000
    target_lr: float = 2e-3
    draft_steps: int = 2000
    draft_lr: float = 2e-3
    ttt_steps: int = 4
    warmup: int = 100
    weight_decay: float = 0.1
    eval_every: int = 100
    seed: int = 0

    def target_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=256, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            intermediate_size=self.intermediate_size, max_seq_len=self.seq_len + self.ttt_steps, max_batch=1,
            aux_layers=eagle3_aux_layers(self.n_layers),
        )


PRESETS = MappingProxyType({
    "tiny-code": TrainConfig(),
    # Seconds on a CPU: exercises every code path, learns little.
    "smoke": TrainConfig(dim=32, n_layers=4, n_heads=2, n_kv_heads=1, intermediate_size=64, seq_len=64, batch=4,
                         target_steps=6, draft_steps=4, ttt_steps=3, warmup=2, eval_every=3),
})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % HELD_OUT_MODULUS == 0


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files of one split (``"train"`` or ``"held_out"``), sorted."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in ("site-packages", "dist-packages", "__pycache__") for part in path.relative_to(root).parts):
            continue
        if is_held_out(rel) == (split == "held_out"):
            files.append(path)
    if not files:
        raise FileNotFoundError(f"no Python source files for split {split!r} under {root}")
    return files


def load_corpus(split: str, root: Path | None = None) -> torch.Tensor:
    """All files of a split as one uint8 tensor, NUL-separated."""
    chunks = []
    for path in corpus_files(split, root):
        chunks.append(path.read_bytes().replace(b"\x00", b""))
    return torch.frombuffer(bytearray(bytes([DOCUMENT_SEPARATOR]).join(chunks)), dtype=torch.uint8)


def sample_windows(data: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - length, (batch,), generator=generator)
    return torch.stack([data[s : s + length] for s in starts.tolist()]).long()


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, mininterval=1.0)


def _init_normal(model: torch.nn.Module, std: float = 0.02) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                torch.nn.init.normal_(p, std=std)
    return model


def _optimise(params, total: int, peak_lr: float, cfg: TrainConfig, desc: str, progress: bool, batches, step_loss) -> None:
    """AdamW with warm-up and cosine decay over ``total`` minibatches.

    ``step_loss(step, windows) -> (loss, after)``; ``after(step)`` runs once the
    optimiser has stepped (logging, evaluation) and may return a progress-bar postfix.
    """
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    bar = _progress(total, desc, progress)
    for step in range(total):
        for group in opt.param_groups:
            group["lr"] = _lr(step, total, peak_lr, cfg.warmup)
        loss, after = step_loss(step, batches())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        postfix = after(step)
        if postfix:
            bar.set_postfix(**postfix)
        bar.update(1)
    bar.close()


def target_loss(target: Llama, windows: torch.Tensor) -> torch.Tensor:
    logits, _ = target.forward_uncached(windows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


def draft_losses(target: Llama, draft: EagleDraft, windows: torch.Tensor, ttt_steps: int):
    """Per TTT step: soft cross-entropy against the target, and top-1 agreement with it."""
    with torch.no_grad():
        target_logits, features = target.forward_uncached(windows)
    T = windows.shape[1] - 1
    steps_logits = draft.forward_unrolled(windows[:, 1 : T + 1], features[:, :T], ttt_steps)
    return unrolled_losses(steps_logits, target_logits.float().softmax(-1), T)


def unrolled_losses(steps, teacher: torch.Tensor, T: int, counted: torch.Tensor | None = None):
    """Per unrolled step of the draft (``steps``: its logits at each base position): the
    soft cross-entropy against the target's distribution ``teacher`` and the top-1
    agreement with it, averaged over the positions, or over those ``counted`` marks."""
    losses, agreements = [], []
    for j, student in enumerate(steps):
        valid = T - j
        if valid <= 0:
            break
        # Step j at base p proposes token p + j + 2: the target's distribution at p + j + 1.
        taught = teacher[:, j + 1 : j + 1 + valid]
        log_student = student[:, :valid].float().log_softmax(-1)
        entropy = -(taught * log_student).sum(-1)
        agree = taught.argmax(-1) == log_student.argmax(-1)
        if counted is None:
            losses.append(entropy.mean())
            agreements.append(agree.float().mean())
        else:
            mask = counted[:, j + 1 : j + 1 + valid]
            count = mask.sum().clamp(min=1)
            losses.append((entropy * mask).sum() / count)
            agreements.append((agree & mask).sum() / count)
    return losses, agreements


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


@torch.no_grad()
def _held_out_loss(target: Llama, batches: list[torch.Tensor], device) -> float:
    target.eval()
    with _autocast(device):
        value = sum(float(target_loss(target, b.to(device))) for b in batches) / len(batches)
    target.train()
    return value


def _train_target(cfg: TrainConfig, tcfg: LlamaConfig, device: torch.device, batches, held_batches: list,
                  history: dict, progress: bool) -> Llama:
    """The target from scratch on next-token loss; its train and held-out losses go into
    ``history``.  Returns it frozen, in eval mode."""
    target = _init_normal(Llama(tcfg).to(device))
    step_fn = torch.compile(target_loss) if device.type == "cuda" else target_loss

    def target_step(step: int, windows: torch.Tensor):
        with _autocast(device):
            loss = step_fn(target, windows)

        def after(step: int) -> dict | None:
            if (step + 1) % cfg.eval_every == 0 or step == cfg.target_steps - 1:
                history["target_held_out"].append((step, _held_out_loss(target, held_batches, device)))
            if step % 10 == 0 or step == cfg.target_steps - 1:
                history["target"].append((step, loss.item()))
                return dict(loss=f"{loss.item():.3f}")
            return None

        return loss, after

    target.train()
    _optimise(list(target.parameters()), cfg.target_steps, cfg.target_lr, cfg, "target", progress, batches, target_step)
    target.eval().requires_grad_(False)
    return target


def _train_draft(cfg: TrainConfig, tcfg: LlamaConfig, device: torch.device, target: Llama, batches, history: dict,
                 progress: bool) -> EagleDraft:
    """The EAGLE3 draft over the frozen target (its embedding shared and frozen), on the
    test-time-training losses of ``cfg.ttt_steps`` chained steps, weighted ``0.8**j``; its
    losses and agreement go into ``history``.  Returns it frozen, in eval mode."""
    draft = _init_normal(EagleDraft(DraftConfig(tcfg, "eagle3", n_features=len(tcfg.aux_layers))).to(device))
    draft.embed.weight.data.copy_(target.tok_embeddings.weight)
    draft.embed.weight.requires_grad_(False)
    weights = [0.8**j for j in range(cfg.ttt_steps)]

    def draft_step(step: int, windows: torch.Tensor):
        with _autocast(device):
            losses, agreements = draft_losses(target, draft, windows, cfg.ttt_steps)
            loss = sum(w * l for w, l in zip(weights, losses)) / sum(weights[: len(losses)])

        def after(step: int) -> dict | None:
            if step % 10 == 0 or step == cfg.draft_steps - 1:
                history["draft"].append((step, [x.item() for x in losses]))
                history["draft_agreement"].append((step, [float(x) for x in agreements]))
                return dict(loss=f"{loss.item():.3f}", top1=f"{float(agreements[0]):.2f}")
            return None

        return loss, after

    draft.train()
    trainable = [p for p in draft.parameters() if p.requires_grad]
    _optimise(trainable, cfg.draft_steps, cfg.draft_lr, cfg, "draft", progress, batches, draft_step)
    draft.eval().requires_grad_(False)
    return draft


def train(cfg: TrainConfig, out: Path, device: torch.device, *, progress: bool = True, log=print) -> dict:
    """Train target then draft, save both to ``out``; returns the training record."""
    from dcp_compile.models.pretrained import save_pair

    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    started = time.perf_counter()
    train_data, held_data = load_corpus("train"), load_corpus("held_out")
    log(f"corpus: {len(corpus_files('train'))} train files ({train_data.numel() / 1e6:.1f} MB), "
        f"{len(corpus_files('held_out'))} held-out files ({held_data.numel() / 1e6:.2f} MB) from {stdlib_root()}")
    if train_data.numel() <= cfg.seq_len + 1 or held_data.numel() <= cfg.seq_len + 1:
        raise ValueError(f"corpus too small for seq_len={cfg.seq_len}")
    held_batches = [sample_windows(held_data, cfg.batch, cfg.seq_len + 1, torch.Generator().manual_seed(1000 + i))
                    for i in range(4)]

    def batches():
        return sample_windows(train_data, cfg.batch, cfg.seq_len + 1, gen).to(device)

    tcfg = cfg.target_config()
    history: dict[str, list] = dict(target=[], target_held_out=[], draft=[], draft_agreement=[])
    target = _train_target(cfg, tcfg, device, batches, held_batches, history, progress)
    draft = _train_draft(cfg, tcfg, device, target, batches, history, progress)
    record = dict(
        train_config=asdict(cfg),
        data=dict(source=str(stdlib_root()), held_out_rule=f"crc32(relative path) % {HELD_OUT_MODULUS} == 0",
                  train_bytes=int(train_data.numel()), held_out_bytes=int(held_data.numel())),
        final=dict(target_train_loss=history["target"][-1][1], target_held_out_loss=history["target_held_out"][-1][1],
                   draft_step_losses=history["draft"][-1][1], draft_step_agreement=history["draft_agreement"][-1][1]),
        seconds=time.perf_counter() - started,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
    )
    save_pair(out, target, draft, extra=dict(training=record))
    (Path(out) / "history.json").write_text(json.dumps(history) + "\n")
    return record


def held_out_prompts(n: int, prompt_bytes: int, seed: int = 0, root: Path | None = None,
                     codec=None) -> list[list[int]]:
    """``n`` prompts of ``prompt_bytes`` bytes, each ending at a line end, from held-out files.

    ``codec`` (``text.Codec``): the prompts as that tokenizer's ids of the same text (a
    slice that starts inside a character starts with U+FFFD); ``None``: the bytes."""
    gen = torch.Generator().manual_seed(seed)
    files = [p.read_bytes() for p in corpus_files("held_out", root)]
    files = [f for f in files if len(f) > 4 * prompt_bytes]
    prompts = []
    while len(prompts) < n:
        text = files[int(torch.randint(len(files), (1,), generator=gen))]
        end = int(torch.randint(prompt_bytes, len(text) - prompt_bytes, (1,), generator=gen))
        end = text.rfind(b"\n", prompt_bytes, end + 1) + 1
        if end > prompt_bytes:
            prompts.append(list(text[end - prompt_bytes : end]))
    if codec is not None:
        return [codec.encode(bytes(p).decode("utf-8", errors="replace")) for p in prompts]
    return prompts


def measure_acceptance(
    model, *, device="cpu", k: int = 4, topk: int = 1, draft_tokens: int | None = None, n_prompts: int = 32,
    prompt_bytes: int = 192, new_tokens: int = 128, batch: int = 16, lowering: str = "aot_eager",
    prompts: list[list[int]] | None = None, prompt_kind: str = "given prompts", stop_ids=(), group=None,
    page_size: int = 0, kv_tokens: int | None = None,
) -> dict:
    """Greedy EAGLE decoding of held-out prompts: mean accept length at depth ``k``,
    drafting the chain or (``topk``, ``draft_tokens``) an EAGLE-2 tree; on one rank, or on
    this rank of ``group`` (the target sharded over its TP ranks, its KV over its DCP ranks).

    ``model``: a shipped name or checkpoint directory, or a ``loading.ModelSpec`` (a
    Hugging Face model with its draft: the prompts are the same text through its
    tokenizer; a window of a file has no end, so every request decodes ``new_tokens``).
    ``prompts`` (token ids, described by ``prompt_kind``) replace the held-out files, and
    ``stop_ids`` end a request: ``draft_training.evaluation_prompts`` gives a chat model's.
    ``page_size``: the target's KV in a pool of ``kv_tokens`` (default: what the rows hold)."""
    import dcp_compile as dcp
    from dcp_compile.commands import loading, parallel
    from dcp_compile.runtime.tree import default_draft_tokens

    spec = model if isinstance(model, loading.ModelSpec) else loading.resolve(str(model))
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    codec = None if spec.kind == loading.PAIR else loading.codec(spec)
    if prompts is None:
        prompts, kind = held_out_prompts(n_prompts, prompt_bytes, codec=codec), "held-out standard-library files"
    else:
        prompts, kind = prompts[:n_prompts], prompt_kind
    max_seq_len = max(len(p) for p in prompts) + new_tokens + k + 1
    pool = loading.pool_options(page_size, kv_tokens, batch, max_seq_len)
    target, draft = loading.load(spec, max_batch=batch, max_seq_len=max_seq_len, device=device, dtype=dtype,
                                 native=group is not None and group.tp_size > 1, paged=bool(pool))
    if group is None:
        group = dcp.DCPGroup(1, 0, device, None)
    parallel.shard(target, group)
    draft_tokens = default_draft_tokens(k, topk) if draft_tokens is None else draft_tokens
    decoder = dcp.SpecDecoder(target, draft, group, k=k, topk=topk, draft_tokens=draft_tokens, max_batch=batch,
                              max_seq_len=max_seq_len, lowering=lowering, **pool)
    accepted = []
    for start in range(0, n_prompts, batch):
        for out in dcp.generate_all(decoder, prompts[start : start + batch], new_tokens, stop_ids=stop_ids):
            accepted += out.accepted
    paged = {} if decoder.paging is None else dict(kv_pool_tokens=decoder.paging.shape.kv_tokens)
    return dict(k=k, topk=topk, draft_tokens=draft_tokens, prompts=n_prompts, prompt_kind=kind, prompt_bytes=prompt_bytes,
                new_tokens=new_tokens, verify_steps=len(accepted),
                mean_accept_length=sum(a + 1 for a in accepted) / len(accepted),
                accept_histogram=[accepted.count(i) for i in range(k + 1)], **paged)


def preset(name: str, **overrides) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
