"""Every script in examples/ runs as its docstring says and prints its success line.

The command is read from the module docstring (the one indented line that starts with
``torchrun`` or ``python``), so the docs and the test cannot drift apart. ``torchrun`` runs
as ``python -m torch.distributed.run`` and ``python`` as this interpreter, both with the
repository root as the working directory.
"""

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
COMMAND = re.compile(r"^    ((?:torchrun|python) .*)$", re.MULTILINE)


def launch_command(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    commands = COMMAND.findall(docstring)
    assert len(commands) == 1, f"{path.name}: expected one launch command in the docstring, found {commands}"
    assert path.relative_to(ROOT).as_posix() in commands[0], f"{path.name}: the command runs another file"
    return commands[0]


def argv(command: str) -> list[str]:
    program, *args = shlex.split(command)
    return [sys.executable, *(["-m", "torch.distributed.run"] if program == "torchrun" else []), *args]


def success(path: Path, stdout: str) -> bool:
    if path.name.startswith("test_"):  # a pytest file: every test passed
        summary = stdout.strip().splitlines()[-1]
        return re.search(r"\d+ passed", summary) is not None and not re.search(r"failed|error|skipped", summary)
    return re.search(r"^OK: ", stdout, re.MULTILINE) is not None


def test_every_example_is_here():
    assert {p.name for p in EXAMPLES} >= {
        "compile_backend.py", "serving_loop.py", "hf_generate.py", "hf_eagle3.py", "gpt_fast.py", "mla.py",
        "test_my_model.py",
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_as_its_docstring_says(path):
    command = launch_command(path)
    proc = subprocess.run(argv(command), cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = f"$ {command}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, output
    assert success(path, proc.stdout), output
