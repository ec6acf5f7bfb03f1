"""The model cache ($NANOGRPO_CACHE, default ~/.cache/nanogrpo): every folder in it is complete or absent.

`build_once(name, build, check)` returns cache/name, building it first when it is not there or not complete.
A folder counts as complete only when its `manifest.json` (written last, as the checkpoints' is) lists every
file with its size and sha256, and the files on disk still match: sizes always, the content whenever a file's
modification time is not the one recorded (a file rewritten in place at the same size is caught; a copy made
with `cp -r` is hashed once per load). Anything else under that name (a folder without a manifest, one with a
file missing or changed, a plain file) is moved aside to `NAME.damaged`, with one printed line, and built
again: a damaged cache costs one rebuild, never every run after it.

A build runs in a temporary folder (`.NAME.build-XXXX`), is checked there (`check(folder)` raises on what a
load would trip over), gets its manifest, and is renamed into place. Builders of one name take a file lock
(`.NAME.lock`), so concurrent first users (pytest workers, torchrun ranks, two runs) wait for one build instead
of racing; a builder killed at any point leaves at most a temporary folder, which no lookup mistakes for a
model and the next build removes (the lock dies with its holder). Nothing here reads the process's rank.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from filelock import FileLock, Timeout

from nanogrpo.infra.metrics import replace_atomically, sha256_file
from nanogrpo_base.files import file_mode, umask

MANIFEST = "manifest.json"  # {"files": {name: {"size", "sha256", "mtime_ns"}}}
# storage faults that the user fixes by freeing space or choosing another folder, not bugs
_STORAGE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST}


def cache_dir() -> Path:
    return Path(os.environ.get("NANOGRPO_CACHE") or Path.home() / ".cache" / "nanogrpo")


def why_incomplete(folder: Path, require: Iterable[str] = ()) -> str | None:
    """Why `folder` is not a complete cache entry, or None when it is."""
    if folder.is_symlink() or not folder.exists():
        return "it is missing" if not folder.is_symlink() else "it is a symbolic link"
    if not folder.is_dir():
        return "it is a file, not a folder"
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (an interrupted build, or one made by an earlier nanogrpo)"
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__})"
    if not isinstance(files, dict) or not all(isinstance(r, dict) and "size" in r for r in files.values()):
        return f"its {MANIFEST} does not list files with their sizes"
    for name in require:
        if name not in files:
            return f"it has no {name}"
    for name, rec in files.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        st = f.stat()
        if st.st_size != rec["size"]:
            return f"{name} has {st.st_size} bytes, not {rec['size']}"
        if st.st_mtime_ns != rec.get("mtime_ns") and sha256_file(f) != rec.get("sha256"):
            return f"{name} does not match its sha256 in {MANIFEST}"
    return None


def write_manifest(folder: Path) -> None:
    """manifest.json for every file in `folder`, written through a rename: its presence marks it complete."""
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            p.chmod(file_mode())  # a cache shared by a group must be readable, whoever wrote the file
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
            st = p.stat()
            files[p.name] = {"size": st.st_size, "sha256": sha256_file(p), "mtime_ns": st.st_mtime_ns}
    replace_atomically(folder / MANIFEST, json.dumps({"files": files}, indent=2) + "\n")


def storage_error(root: Path, e: OSError) -> ValueError:
    """The one-line error for a cache nanogrpo cannot write: the folder, the cause and the fix."""
    if e.errno in (errno.EEXIST, errno.ENOTDIR):
        fix = f"{root} (or a folder above it) is a file, not a folder: point NANOGRPO_CACHE at a folder"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "Free space there, or point NANOGRPO_CACHE at a folder on a disk with room"
    else:
        fix = "Point NANOGRPO_CACHE at a folder you can write (or make this one writable)"
    return ValueError(
        f"cannot write the model cache {root}: {e.strerror or e}. {fix} (NANOGRPO_CACHE=/path/to/folder python ...)"
    )


def _set_aside(root: Path, name: str, why: str) -> None:
    final, aside = root / name, root / f"{name}.damaged"
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside)
    elif aside.exists() or aside.is_symlink():
        aside.unlink()
    os.replace(final, aside)
    print(f"nanogrpo: {final} is not a complete model ({why}): moved to {aside.name}, building it again",
          file=sys.stderr, flush=True)  # fmt: skip


def _clean_temporaries(root: Path, name: str) -> None:
    """Folders of builds that died (only the lock holder builds, so every one found here is dead); also
    the `.NAME-XXXXXXXX` folders earlier nanogrpo versions left behind."""
    for p in [*root.glob(f".{name}.build-*"), *root.glob(f".{name}-????????")]:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def build_once(
    name: str,
    build: Callable[[Path], None],
    check: Callable[[Path], None] = lambda folder: None,
    about: str = "",
    require: Iterable[str] = (),
) -> Path:
    """cache/name, built by build(tmp_folder) and checked by check(tmp_folder) unless already complete.

    about: what is built and how long it takes, for the one line printed when it is; require: files a
    complete folder must list (an entry made without them is rebuilt)."""
    root = cache_dir()
    final = root / name
    if why_incomplete(final, require) is None:  # the common case: no lock, no write
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(root / f".{name}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(
                f"nanogrpo: waiting for another process to finish building {final}",
                file=sys.stderr,
                flush=True,
            )
            lock.acquire()
    except OSError as e:
        raise storage_error(root, e) from e
    try:
        why = why_incomplete(final, require)
        if why is None:  # built by the process we waited for
            return final
        _clean_temporaries(root, name)
        if final.exists() or final.is_symlink():
            _set_aside(root, name, why)
        print(f"nanogrpo: building {final} ({about or 'once'})", file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=root))
        try:
            build(tmp)
            check(tmp)  # before the manifest: a folder that would not load is never marked complete
            write_manifest(tmp)
            tmp.chmod(0o777 & ~umask())  # mkdtemp makes it private; the cache may be shared by a group
            os.rename(tmp, final)
            fd = os.open(root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno in _STORAGE:
                raise storage_error(root, e) from e
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final
    finally:
        lock.release()


def private_inductor_cache() -> None:
    """Point inductor's on-disk cache (compiled kernels, loaded as code) at a folder of this user's own,
    unless TORCHINDUCTOR_CACHE_DIR names one already.

    Inductor's default is /tmp/torchinductor_$USER: any user of the machine can make that folder first and
    fill it with kernels this process would then load and run. nanogrpo compiles into its cache folder
    instead (~/.cache/nanogrpo, or $NANOGRPO_CACHE), refusing one that another user owns or may write. A
    process that runs other CPU code paths (ATEN_CPU_CAPABILITY=avx2, as bench/cpu_check.py --avx2 sets) gets
    a folder of its own: inductor reused the kernels one capability compiled in a process of the other, which
    then read out of bounds or crashed (double free). The C++ precompiled headers (~150 MB each) go there too
    (`_headers_into`). Nothing of torch._inductor is imported before the variable is set: importing it makes
    its default folder in /tmp."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # inductor writes its default there once it looks
    if chosen:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
            _headers_into(chosen)
            return  # the user's own choice

    folder = cache_dir() / f"inductor-{os.environ.get('ATEN_CPU_CAPABILITY') or 'default'}"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(cache_dir(), e) from e
    st = folder.stat()
    if (hasattr(os, "getuid") and st.st_uid != os.getuid()) or st.st_mode & 0o022:
        raise RuntimeError(
            f"{folder} holds compiled code this process would run, and another user owns it or may write to "
            f"it (mode {st.st_mode & 0o777:o}): remove it, or set TORCHINDUCTOR_CACHE_DIR to a folder of your own"
        )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    _headers_into(str(folder))


def _headers_into(folder: str) -> None:
    """Inductor's C++ precompiled headers into `folder`/precompiled_headers. Inductor keeps them in
    /tmp/torchinductor_$USER whatever TORCHINDUCTOR_CACHE_DIR says: torch._inductor.codecache computes that
    folder once, at its import, from default_cache_dir(), and reads the module's _HEADER_DIR at every use, so
    it is set here. A torch without that name gets no precompiled headers (slower compiles, nothing in /tmp)."""
    from torch._inductor import codecache, config

    if isinstance(getattr(codecache, "_HEADER_DIR", None), str):
        codecache._HEADER_DIR = os.path.join(folder, "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")
    else:
        config.cpp_cache_precompile_headers = False
        config.aot_inductor.precompile_headers = False
