"""A Llama-3-8B-shaped Hugging Face directory with random weights, and an EAGLE3 draft for
it in the published layout: what a user's checkpoint and SpecForge's draft look like on
disk, without downloading either.

- ``target/``: ``LlamaForCausalLM`` (32 layers, width 4096, 32/8 heads, MLP 14336,
  vocabulary 128,256, rope_theta 500000), bf16 safetensors in 5 GB shards as the
  published checkpoint is, ``generation_config.json`` with Llama-3's two EOS ids, and a
  byte-level tokenizer over the 128,256 ids (ids 0-255 are the bytes, the rest decode
  to three-character strings; the two EOS ids are special tokens).
- ``draft/``: EAGLE3 ``midlayer.*``, ``fc`` (3 x 4096 -> 4096), ``norm``, ``lm_head`` over
  a 32,000-token draft vocabulary with its ``d2t``, no ``embed_tokens``, no
  ``rope_theta`` (10000, as SpecForge's Llama-3.1-8B config has it).

Random weights (std 0.02) make near-uniform logits: the draft's proposals are accepted
about as often as chance, so a speculative step emits about one token.  The shapes, the
bytes moved and the load are the real ones.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

VOCAB, DRAFT_VOCAB, EOS_IDS = 128256, 32000, (128001, 128009)


def _tokenizer():
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from dcp_compile.commands.export import gpt2_byte_chars

    chars = gpt2_byte_chars()
    vocab = {chars[b]: b for b in range(256)}
    i = 256
    for a in chars:
        for b in chars:
            for c in chars:
                if i == VOCAB:
                    break
                vocab[a + b + c] = i
                i += 1
            if i == VOCAB:
                break
        if i == VOCAB:
            break
    names = {EOS_IDS[0]: "<|end_of_text|>", EOS_IDS[1]: "<|eot_id|>"}
    by_id = {v: k for k, v in vocab.items()}
    for token_id, name in names.items():
        del vocab[by_id[token_id]]
        vocab[name] = token_id
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names.values()])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=names[EOS_IDS[0]],
                                                pad_token=names[EOS_IDS[0]], clean_up_tokenization_spaces=False)


def write_llama3_8b(directory: Path, *, seed: int = 0, n_layers: int = 32, device: str = "cuda") -> dict:
    """Write ``directory/target`` and ``directory/draft`` unless both are there
    (``n_layers`` and ``device``: a shallower copy for checking the script on a CPU)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    target, draft = directory / "target", directory / "draft"
    if (target / "config.json").is_file() and (draft / "model.safetensors").is_file():
        return dict(target=str(target), draft=str(draft), written=False)
    start = time.perf_counter()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336, num_hidden_layers=n_layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=list(EOS_IDS))
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=list(EOS_IDS), bos_token_id=None)
    model.save_pretrained(target, max_shard_size="5GB")
    _tokenizer().save_pretrained(target)
    target_params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    written_target = time.perf_counter() - start

    gen = torch.Generator(device=device).manual_seed(seed + 1)
    H, I, heads, kv, hd = 4096, 14336, 32, 8, 128

    def w(*shape):
        return (0.02 * torch.randn(*shape, generator=gen, device=device)).to(torch.bfloat16).cpu()

    used = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB].sort().values
    state = {
        "fc.weight": w(H, 3 * H),
        "midlayer.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "midlayer.hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, heads * hd),
        "midlayer.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "midlayer.mlp.gate_proj.weight": w(I, H),
        "midlayer.mlp.up_proj.weight": w(I, H),
        "midlayer.mlp.down_proj.weight": w(H, I),
        "norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": w(DRAFT_VOCAB, H),
        "d2t": used - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, used, True),
    }
    draft.mkdir(parents=True, exist_ok=True)
    save_file(state, str(draft / "model.safetensors"))
    (draft / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=H, intermediate_size=I,
        num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=1, rms_norm_eps=1e-5, hidden_act="silu",
        vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, max_position_embeddings=2048, tie_word_embeddings=False,
    ), indent=2))
    return dict(target=str(target), draft=str(draft), written=True, target_parameters=target_params,
                draft_parameters=sum(v.numel() for k, v in state.items() if v.is_floating_point()),
                target_write_s=written_target, total_write_s=time.perf_counter() - start)
