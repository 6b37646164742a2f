"""Reading the JSON files of checkpoint directories, with errors that name the file; and
writing a file so that a reader never finds it half-written."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


def read_json_object(path: Path, what: str = "") -> dict:
    """The JSON object in ``path``; ``ValueError`` naming the file when it is not valid JSON
    or not an object (``what``: the fix, appended to the message)."""
    fix = f"; {what}" if what else ""
    try:
        value = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}){fix}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, expected an object{fix}")
    return value


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """``write(temp)`` to a temporary name beside ``path``, then rename it to ``path``: a
    reader sees the old file or the whole new one, never part of it."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.partial")
    write(temp)
    os.replace(temp, path)
