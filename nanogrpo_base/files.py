"""Files written with the user's umask: the mode every writer gives a new file, and the one writer of weights.

`save_tensors` is every .safetensors file's write (a model, an adapter, a checkpoint, PPO's value head, a
probe): safetensors writes through a temporary file it creates mode 0600, which a copied run folder or a
cache shared by a group could not read; the file gets 0o666 & ~umask, the mode of any other file, and
safetensors' I/O errors come back as the OSError they are (a full disk is then a storage error, not a
SafetensorError traceback).
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def umask() -> int:
    """This process's umask (every writer of nanogrpo and rewards gives its files 0o666 & ~umask), read
    without changing it where /proc says it (os.umask sets it to read it: a file another thread creates
    meanwhile would get the wrong mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets from open(): 0o666 less the umask (0o644 under umask 022)."""
    return 0o666 & ~umask()


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def save_tensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, then the file's mode set by the umask; an I/O error (a full disk, a read-only
    folder) raised as OSError with its errno."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        m = _OS_ERROR.search(str(e))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e
    os.chmod(path, file_mode())
