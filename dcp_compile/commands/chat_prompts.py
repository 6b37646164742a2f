"""Chat prompts from the Python standard library: what ``dcp-compile train-draft`` asks a
model to answer (the ``train`` split), and what ``dcp-compile eval`` asks a chat model
(the ``held_out`` split), split by file as the shipped pair's data is
(``training.corpus_files``)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import torch

from dcp_compile.commands.training import corpus_files


def _documented_functions(path: Path) -> list[tuple[str, str, str]]:
    """``(name, first docstring sentence, source)`` of each documented top-level or method
    function in one file."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        lines = source.split("\n")
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node) or ""
        first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        if not (20 <= len(first) <= 160) or not first[0].isalpha():
            continue
        if node.end_lineno - node.lineno > 40:
            continue
        body = textwrap.dedent("\n".join(lines[node.lineno - 1 - len(node.decorator_list) : node.end_lineno]))
        if len(body) > 1200:
            continue
        found.append((node.name, first.rstrip("."), body))
    return found


def chat_prompts(split: str, n: int, seed: int = 0, root: Path | None = None) -> list[str]:
    """``n`` user requests about the documented functions of the standard library's
    ``split`` (``"train"`` or ``"held_out"``, by file, as ``training.corpus_files``), in
    four forms: write a function that does what a docstring says, explain a function's
    code, how to do it in Python, and write its tests.  Files are read in a seeded order
    until ``n`` functions are found (a split with fewer is cycled), so the list is the same
    on every machine with the same Python."""
    files = corpus_files(split, root)
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
    items = []
    for index in order:
        path = files[index]
        module = path.stem if path.stem != "__init__" else path.parent.name
        items += [(module, *item) for item in _documented_functions(path)]
        if len(items) >= n:
            break
    if not items:
        raise FileNotFoundError(f"no documented functions in the {split!r} split of the standard library")
    # Shuffled again, so that neighbouring prompts (and so a batch) come from different files.
    mixed = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    prompts = []
    for i in range(n):
        module, name, doc, body = items[mixed[i % len(items)]]
        doc = doc[0].lower() + doc[1:]
        form = i % 4
        if form == 0:
            prompts.append(f"Write a Python function `{name}` that does this: {doc}.")
        elif form == 1:
            prompts.append(f"Explain what this function from Python's `{module}` module does:\n\n```python\n{body}\n```")
        elif form == 2:
            prompts.append(f"How do I {doc} in Python? Show a short example.")
        else:
            prompts.append(f"Write two unit tests for this function:\n\n```python\n{body}\n```")
    return prompts


def prompt_ids(codec, prompts: list[str]) -> list[list[int]]:
    """The prompts through the model's chat template, or as plain text without one."""
    if getattr(codec, "has_chat_template", False):
        return [codec.chat_ids([{"role": "user", "content": p}]) for p in prompts]
    return [codec.encode(p) for p in prompts]


def evaluation_prompts(spec, n: int) -> dict:
    """``measure_acceptance``'s prompts for ``spec``: held-out chat prompts through the
    chat template of a model that has one, each answer ending at an EOS id; nothing (its
    held-out files) otherwise."""
    from dcp_compile.commands import loading

    codec = None if spec.kind == loading.PAIR else loading.codec(spec)
    if not getattr(codec, "has_chat_template", False):
        return {}
    return dict(prompts=prompt_ids(codec, chat_prompts("held_out", n)), prompt_kind="held-out chat prompts",
                stop_ids=sorted(codec.eos_ids))
