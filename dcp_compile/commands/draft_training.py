"""``dcp-compile train-draft``: an EAGLE3 draft for a Hugging Face or GGUF causal LM,
trained on the target's own answers and written in the published layout.

    dcp-compile train-draft --model smollm2 --out drafts/smollm2       # about an hour on 2 CPU cores
    dcp-compile train-draft --model DIR --out D --device cuda --prompts 20000 --steps 20000

**Data.**  Chat prompts made from the docstrings and code of the running interpreter's
standard library (the ``train`` split of ``chat_prompts``), answered greedily by the
target itself, as EAGLE and SpecForge recommend: the draft
learns what *this* target says.  A model without a chat template gets the prompts as plain
text.  Held-out files give the evaluation prompts (``dcp-compile eval``).

**Draft vocabulary.**  The ``draft_vocab`` target ids the conversations use most (and
the model's EOS ids), as ``d2t``/``t2d``.

**Start.**  The draft begins as the target's early exit at its last feature layer
``L-3``: its decoder layer is a copy of target layer ``L-3`` reading the hidden half of its
input, ``fc`` passes that layer's input through, and ``norm``/``lm_head`` are the target's
(restricted to the draft vocabulary).  Training then adapts it, with the rest of the
features, to predict ``ttt_steps`` tokens ahead.

**Loss.**  As the shipped pair's draft (``training.draft_losses``): the draft unrolled
``ttt_steps`` times on its own hidden states, each step a soft cross-entropy against the
target's distribution over the draft vocabulary, weighted ``0.8 ** j``, on answer tokens
only, where the target's top token is in the draft vocabulary.

**Resuming.**  ``OUT/training/`` holds the answers (appended batch by batch), the
vocabulary and a checkpoint every ``checkpoint_every`` steps; the same command continues
where it stopped.  The draft files are written last, under temporary names then renamed,
so ``OUT`` never holds half a draft.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from dcp_compile.commands.chat_prompts import chat_prompts, evaluation_prompts, prompt_ids
from dcp_compile.commands.training import _lr, _progress, unrolled_losses
from dcp_compile.files import write_whole
from dcp_compile.models.draft_config import DraftConfig, eagle3_aux_layers

WORK = "training"
DRAFT_FILES = ("config.json", "model.safetensors")
WEIGHTS = tuple(0.8**j for j in range(16))


@dataclass(frozen=True)
class DraftTrainConfig:
    prompts: int = 480
    """Training prompts the target answers."""
    max_new_tokens: int = 160
    """Longest answer generated per prompt."""
    generate_batch: int = 32
    draft_vocab: int = 8192
    steps: int = 120
    batch: int = 8
    """Conversations per training step."""
    max_len: int = 512
    """Conversations are cut to this many tokens."""
    lr: float = 1e-3
    warmup: int = 15
    ttt_steps: int = 4
    checkpoint_every: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "seed" and not value > 0:
                raise ValueError(f"train-draft --{f.name.replace('_', '-')} must be positive, got {value}")
        if self.ttt_steps > len(WEIGHTS):
            raise ValueError(f"train-draft --ttt-steps is at most {len(WEIGHTS)}, got {self.ttt_steps}")


# -- the target ----------------------------------------------------------------------------

def check_target(config) -> tuple[int, ...]:
    """The feature layers of an EAGLE3 draft for this HF config, or a ``ValueError`` naming
    what the draft could not read."""
    from dcp_compile.hf.cache import _refuse_sliding
    from dcp_compile.hf.causal_lm import llama_config

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    if not layers or layers < 4:
        raise ValueError(
            f"an EAGLE3 draft reads the hidden states entering three target layers (2, L//2, L-3); "
            f"{type(text).__name__} has {layers} layers, and needs at least 4"
        )
    _refuse_sliding(text)
    aux = eagle3_aux_layers(layers)
    llama_config(text, max_batch=1, max_seq_len=1, aux_layers=aux)  # raises for shapes a Llama layer cannot take
    return aux


class TargetOutputs:
    """What the draft trains on: the target's EAGLE3 features and logits over a batch."""

    def __init__(self, model, aux_layers: tuple[int, ...]):
        self.model, self.aux_layers = model, aux_layers

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids=tokens, output_hidden_states=True, use_cache=False)
        # hidden_states[i] is what enters layer i (0: the embedding).
        features = torch.cat([out.hidden_states[i] for i in self.aux_layers], dim=-1)
        return out.logits, features


# -- data ----------------------------------------------------------------------------------

def generate_answers(model, codec, prompts: list[list[int]], path: Path, cfg: DraftTrainConfig, *,
                     progress: bool) -> list[dict]:
    """Greedy answers of the target to ``prompts``, appended to ``path`` (one JSON line a
    conversation) batch by batch; a rerun continues after the last whole batch."""
    done = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                done.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut off mid-write: generate it again
        path.write_text("".join(json.dumps(d) + "\n" for d in done))
    eos = sorted(codec.eos_ids)
    pad = eos[0] if eos else 0
    device = next(model.parameters()).device
    bar = _progress(len(prompts), "answers", progress)
    bar.update(len(done))
    with path.open("a") as sink:
        for start in range(len(done), len(prompts), cfg.generate_batch):
            chunk = prompts[start : start + cfg.generate_batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                     do_sample=False, pad_token_id=pad, eos_token_id=eos or None)
            for prompt, row in zip(chunk, out[:, width:].tolist()):
                answer = []
                for token in row:
                    answer.append(token)
                    if token in codec.eos_ids:
                        break
                record = dict(prompt=prompt, answer=answer)
                done.append(record)
                sink.write(json.dumps(record) + "\n")
            sink.flush()
            bar.update(len(chunk))
    bar.close()
    return done


def draft_vocabulary(conversations: list[dict], size: int, vocab_size: int, keep: frozenset[int]) -> torch.Tensor:
    """The target ids of the draft vocabulary, ascending: ``keep`` (the EOS ids), then the
    ids the conversations (prompts and answers) use most (ties: the lower id), then the
    lowest unused ids if they use fewer than ``size``."""
    if size > vocab_size:
        raise ValueError(f"train-draft --draft-vocab {size} is larger than the target's vocabulary ({vocab_size})")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for c in conversations:
        counts.index_add_(0, torch.tensor(c["prompt"] + c["answer"], dtype=torch.long), torch.ones(
            len(c["prompt"]) + len(c["answer"]), dtype=torch.long))
    order = sorted(range(vocab_size), key=lambda t: (t not in keep, -int(counts[t]), t))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)


def batches(conversations: list[dict], cfg: DraftTrainConfig, pad: int, step: int):
    """Step ``step``'s batch: ``(tokens [B, T], answer [B, T])``, ``answer[b, t]`` True
    where token ``t`` is part of an answer.  Epochs are seeded shuffles, so a resumed run
    sees the batches it would have seen."""
    per_epoch = max(1, len(conversations) // cfg.batch)
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(conversations), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
    chosen = [conversations[i] for i in order[index * cfg.batch : (index + 1) * cfg.batch]]
    rows = [(c["prompt"] + c["answer"])[: cfg.max_len] for c in chosen]
    width = max(map(len, rows))
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    answer = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, (c, row) in enumerate(zip(chosen, rows)):
        tokens[b, : len(row)] = torch.tensor(row)
        answer[b, len(c["prompt"]) : len(row)] = True
    return tokens, answer


# -- the draft -----------------------------------------------------------------------------

def build_draft(model, aux_layers: tuple[int, ...], vocab: torch.Tensor, cfg: DraftTrainConfig):
    """The EAGLE3 draft for ``model``, started as its early exit at layer ``aux_layers[-1]``
    (the module docstring), with the target's embedding, frozen."""
    from dcp_compile.hf.causal_lm import llama_config
    from dcp_compile.models.eagle import EagleDraft
    from dcp_compile.models.rope_layout import rotate_half_to_interleaved

    text = model.config.get_text_config(decoder=True)
    shapes = llama_config(text, max_batch=1, max_seq_len=cfg.max_len + cfg.ttt_steps, aux_layers=aux_layers)
    draft = EagleDraft(DraftConfig(shapes, "eagle3", draft_vocab_size=len(vocab)))
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    source = decoder.layers[aux_layers[-1]]
    width = shapes.dim
    with torch.no_grad():
        attention = draft.attention
        for ours, theirs, heads in ((attention.wq, source.self_attn.q_proj, shapes.n_heads),
                                    (attention.wk, source.self_attn.k_proj, shapes.n_kv_heads),
                                    (attention.wv, source.self_attn.v_proj, None)):
            weight = theirs.weight.float()
            if heads is not None:
                weight = rotate_half_to_interleaved(weight, heads)
            ours.weight.zero_()
            ours.weight[:, width:] = weight  # the hidden half; the embedding half learns from zero
        attention.wo.weight.copy_(source.self_attn.o_proj.weight)
        draft.hidden_norm.weight.copy_(source.input_layernorm.weight)
        draft.embed_norm.weight.fill_(1.0)
        draft.ffn_norm.weight.copy_(source.post_attention_layernorm.weight)
        draft.feed_forward.w1.weight.copy_(source.mlp.gate_proj.weight)
        draft.feed_forward.w3.weight.copy_(source.mlp.up_proj.weight)
        draft.feed_forward.w2.weight.copy_(source.mlp.down_proj.weight)
        draft.fc.weight.zero_()
        draft.fc.weight[:, (len(aux_layers) - 1) * width :] = torch.eye(width)
        draft.norm.weight.copy_(decoder.norm.weight)
        draft.head.weight.copy_(model.get_output_embeddings().weight[vocab])
        draft.d2t.copy_(vocab - torch.arange(len(vocab)))
        draft.embed.weight.copy_(model.get_input_embeddings().weight)
    draft.embed.weight.requires_grad_(False)
    return draft


def draft_losses(draft, logits: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor, answer: torch.Tensor,
                 vocab: torch.Tensor, ttt_steps: int):
    """Per unrolled step: the masked soft cross-entropy against the target's distribution
    over the draft vocabulary, and the top-1 agreement, on answer tokens whose target top
    token the draft vocabulary holds."""
    in_vocab = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    in_vocab[vocab] = True
    T = tokens.shape[1] - 1
    # The target at q predicts token q + 1: it teaches where that token is an answer's
    # and its own top token is one the draft can propose.
    counted = F.pad(answer[:, 1:], (0, 1)) & in_vocab[logits.argmax(-1)]
    teacher = logits[..., vocab].float().softmax(-1)
    steps = draft.forward_unrolled(tokens[:, 1 : T + 1], features[:, :T], ttt_steps)
    return unrolled_losses(steps, teacher, T, counted)


# -- the command ---------------------------------------------------------------------------

def refuse_existing_draft(out: Path, overwrite: bool) -> None:
    held = [name for name in DRAFT_FILES if (out / name).exists()]
    if held and not overwrite:
        raise FileExistsError(
            f"{out} already holds a draft ({', '.join(held)}); train-draft replaces one only with --overwrite"
        )


def _start_run(model_name: str, out: Path, cfg: DraftTrainConfig, overwrite: bool):
    """The checked model (``loading.ModelSpec``), its feature layers, and the work
    directory, whose settings must match a run being resumed."""
    from transformers import AutoConfig

    from dcp_compile.commands import loading

    refuse_existing_draft(out, overwrite)
    spec = loading.resolve(model_name)
    if spec.kind == loading.PAIR:
        raise ValueError(
            f"{model_name!r} is a pair of this package, which brings its own draft: `dcp-compile train` trains both; "
            f"train-draft takes a Hugging Face or GGUF model"
        )
    aux = check_target(AutoConfig.from_pretrained(str(spec.path), local_files_only=True))
    work = out / WORK
    work.mkdir(parents=True, exist_ok=True)
    settings = dict(asdict(cfg), model=str(spec.source or spec.path))
    settings_path = work / "settings.json"
    if settings_path.exists():
        before = json.loads(settings_path.read_text())
        changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
        if changed:
            raise ValueError(
                f"{work} holds a run with other settings "
                f"({', '.join(f'{k}: {a} -> {b}' for k, (a, b) in changed.items())}): rerun with the same settings "
                f"to resume, or pass a new --out"
            )
    settings_path.write_text(json.dumps(settings, indent=2) + "\n")
    return spec, aux, work


def _vocabulary(work: Path, conversations: list[dict], cfg: DraftTrainConfig, model, codec) -> torch.Tensor:
    path = work / "vocab.pt"
    if path.exists():
        return torch.load(path)
    vocab = draft_vocabulary(conversations, cfg.draft_vocab, model.config.get_text_config(decoder=True).vocab_size,
                             codec.eos_ids)
    write_whole(path, lambda temp: torch.save(vocab, temp))
    return vocab


def _optimise(draft, outputs: TargetOutputs, conversations: list[dict], vocab: torch.Tensor, cfg: DraftTrainConfig,
              *, pad: int, checkpoint_path: Path, progress: bool, log) -> dict:
    """The training steps, from the checkpoint if there is one; returns the history of
    each step's losses and agreements by unrolled step."""
    dev = vocab.device
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    history, first = dict(loss=[], agreement=[]), 0
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, weights_only=False)
        draft.load_state_dict(state["draft"], strict=False)  # the embedding is the target's
        opt.load_state_dict(state["optimizer"])
        first, history = state["step"], state["history"]
        log(f"resuming at step {first} of {cfg.steps} from {checkpoint_path}")
    bar = _progress(cfg.steps, "draft", progress)
    bar.update(first)
    draft.train()
    for step in range(first, cfg.steps):
        tokens, answer = (t.to(dev) for t in batches(conversations, cfg, pad, step))
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg.steps, cfg.lr, cfg.warmup)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits, features = outputs(tokens)
            losses, agreements = draft_losses(draft, logits, features.to(draft.dtype), tokens, answer, vocab,
                                              cfg.ttt_steps)
            loss = sum(w * l for w, l in zip(WEIGHTS, losses)) / sum(WEIGHTS[: len(losses)])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history["loss"].append([round(x.item(), 4) for x in losses])
        history["agreement"].append([round(x.item(), 4) for x in agreements])
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{agreements[0].item():.2f}")
        bar.update(1)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            trained = {k: v for k, v in draft.state_dict().items() if k != "embed.weight"}
            state = dict(draft=trained, optimizer=opt.state_dict(), step=step + 1, history=history)
            write_whole(checkpoint_path, lambda temp: torch.save(state, temp))
    bar.close()
    draft.eval().requires_grad_(False)
    return history


def train_draft(model_name: str, out: str | Path, *, cfg: DraftTrainConfig = DraftTrainConfig(),
                device: str = "cpu", overwrite: bool = False, progress: bool = True, log=print) -> dict:
    """Train an EAGLE3 draft for ``model_name`` (what ``--model`` accepts) into ``out``;
    returns the record written to ``out/training.json`` (``seconds``: this process's
    time, on a resumed run the part it did)."""
    from dcp_compile.commands import loading
    from dcp_compile.commands.export import write_eagle3_draft
    from dcp_compile.hf.causal_lm import load_causal_lm

    out = Path(out)
    spec, aux, work = _start_run(model_name, out, cfg, overwrite)
    torch.manual_seed(cfg.seed)
    dev = torch.device(device)
    started = time.monotonic()
    model = load_causal_lm(spec.path, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    codec = loading.codec(spec)
    prompts = prompt_ids(codec, chat_prompts("train", cfg.prompts, cfg.seed))
    conversations = generate_answers(model, codec, prompts, work / "answers.jsonl", cfg, progress=progress)
    generated_s = time.monotonic() - started
    vocab = _vocabulary(work, conversations, cfg, model, codec)
    draft = build_draft(model, aux, vocab, cfg).to(dev)
    history = _optimise(draft, TargetOutputs(model, aux), conversations, vocab.to(dev), cfg,
                        pad=min(codec.eos_ids) if codec.eos_ids else 0, checkpoint_path=work / "checkpoint.pt",
                        progress=progress, log=log)
    tail = history["agreement"][-20:]
    record = dict(
        model=str(spec.source or spec.path), settings=asdict(cfg), device=str(dev),
        conversations=len(conversations), answer_tokens=sum(len(c["answer"]) for c in conversations),
        tokens=sum(len(c["prompt"]) + len(c["answer"]) for c in conversations),
        seconds=round(time.monotonic() - started, 1), generate_seconds=round(generated_s, 1),
        final_agreement=[round(sum(a[j] for a in tail) / len(tail), 4) for j in range(len(tail[0]))] if tail else [],
        feature_layers=list(aux), draft_vocab=len(vocab),
    )
    write_eagle3_draft(draft, model, out, record=record, history=history)
    log(f"draft: {out} (EAGLE3, {len(vocab)}-token vocabulary, {record['seconds'] / 60:.1f} min; step-0 agreement "
        f"{record['final_agreement'][0] if record['final_agreement'] else float('nan'):.2f})")
    return record


def measure_and_record(model_name: str, out: str | Path, *, device: str = "cpu", n_prompts: int = 32) -> dict:
    """The trained draft's mean accept length on held-out chat prompts (``training.
    measure_acceptance``: k=4, greedy chain, one rank), added to ``training.json`` and the
    model card; returns the updated record."""
    from dcp_compile.commands import loading
    from dcp_compile.commands.export import draft_card
    from dcp_compile.commands.training import measure_acceptance

    out = Path(out)
    spec = loading.resolve(model_name, str(out))
    acceptance = measure_acceptance(spec, device=device, n_prompts=n_prompts, **evaluation_prompts(spec, n_prompts))
    saved = json.loads((out / "training.json").read_text())
    saved["acceptance"] = acceptance
    for name, text in (("training.json", json.dumps(saved) + "\n"), ("README.md", draft_card(saved))):
        write_whole(out / name, lambda temp: temp.write_text(text))
    return {k: v for k, v in saved.items() if k != "history"}
