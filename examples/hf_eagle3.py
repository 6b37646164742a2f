"""A Hugging Face checkpoint and its EAGLE3 draft: speculative decoding under DCP, against ``generate()``.

``load_causal_lm`` reads the model directory with transformers (from disk, never the
hub); ``DCPCausalLM`` wraps it as a ``(tokens, positions)`` target that also returns the
hidden states of the layers the draft reads (``feature_layers`` of the draft's config);
``EagleDraft.from_pretrained`` reads the draft in the layout SpecForge, SGLang and vLLM
publish; ``dcp.SpecDecoder`` runs EAGLE3 chain speculation at k=4 with the target sharded
by DCP. Every rank checks the greedy tokens against transformers' own greedy
``generate()`` on the same directory, one prompt at a time, EOS included.

    torchrun --standalone --nproc-per-node 2 examples/hf_eagle3.py

Without ``--model DIR --draft DIR`` each rank first writes the shipped tiny-code pair with
``dcp_compile.commands.export.export_pair`` (a ``LlamaForCausalLM`` directory with its tokenizer,
and an EAGLE3 draft) to a temporary directory. Two CPU ranks over gloo, about 30 s. On
GPUs: ``--device cuda --dtype bfloat16`` (NCCL, Inductor/Triton); in bf16 the tokens can
part from ``generate()``'s where two logits are within rounding of each other.
"""

import argparse
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer

import dcp_compile as dcp
from dcp_compile.hf import DCPCausalLM, load_causal_lm
from dcp_compile.models import EagleDraft
from dcp_compile.models.eagle_checkpoint import feature_layers

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(root):\n",
    "class Point:\n    def __init__(self, x, y):\n",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face causal-LM directory")
    parser.add_argument("--draft", help="its EAGLE3 (or EAGLE-1) draft directory")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    if (args.model is None) != (args.draft is None):
        parser.error("give both --model and --draft, or neither (the shipped pair, exported)")

    transformers.logging.disable_progress_bar()
    group = dcp.init_group(args.device)
    device, dtype = group.device, getattr(torch, args.dtype)
    source = args.model or "the exported tiny-code pair"
    if args.model is None:
        from dcp_compile.commands.export import export_pair

        scratch = tempfile.TemporaryDirectory()  # removed when the script exits
        written = export_pair("tiny-code", Path(scratch.name) / "pair")
        args.model, args.draft = written["target"], written["draft"]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = load_causal_lm(args.model, device=device, dtype=dtype)
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]

    with torch.no_grad():  # transformers' greedy generate(), the reference
        expected = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, pad_token_id=eos_ids[0] if eos_ids else None)
            expected.append(out[0, len(prompt):].tolist())

    max_batch, max_seq_len = len(prompts), max(map(len, prompts)) + args.max_new_tokens + 8
    target = DCPCausalLM(model, max_batch=max_batch, max_seq_len=max_seq_len,
                         aux_layers=feature_layers(args.draft, model.config))
    draft = EagleDraft.from_pretrained(args.draft, target, dtype=dtype, device=device)
    decoder = dcp.SpecDecoder(target, draft, group, k=4, max_batch=max_batch, max_seq_len=max_seq_len,
                              lowering="aot_eager" if device.type == "cpu" else "inductor")
    outputs = dcp.generate_all(decoder, prompts, args.max_new_tokens, stop_ids=eos_ids)

    for i, (out, want) in enumerate(zip(outputs, expected)):
        if out.tokens != want:
            raise SystemExit(f"MISMATCH on rank {group.rank}, prompt {i}: speculative {out.tokens}, generate() {want}")
    if group.rank == 0:
        for text, out in zip(PROMPTS, outputs):
            print(f"--- accept length {out.mean_accept_length:.2f} ---\n{text}{tokenizer.decode(out.tokens)}")
        accepted = [a + 1 for o in outputs for a in o.accepted]  # tokens per verify step
        print(f"OK: EAGLE3 speculation (k=4) under DCP size {group.size}: greedy tokens identical to transformers' "
              f"generate() on {source}, {sum(len(o.tokens) for o in outputs)} tokens, mean accept length "
              f"{sum(accepted) / len(accepted):.2f}")


if __name__ == "__main__":
    main()
