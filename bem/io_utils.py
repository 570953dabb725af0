"""Atomic file writes: a temp file in the target's folder, flushed, then renamed over the target."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Union


def atomic_write(path: Union[str, Path], write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)` and move the result onto `path` in one rename.

    A crash at any point leaves either the old file or the new one, never a torn one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Union[str, Path], text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)

    atomic_write(path, write)


def atomic_write_json(path: Union[str, Path], data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def atomic_save_safetensors(path: Union[str, Path], tensors: dict, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    atomic_write(path, lambda tmp: save_file(contiguous, tmp, metadata=metadata))
