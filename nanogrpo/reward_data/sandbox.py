"""Running LLM-written Python style checks: in a child process with limits, never in the caller's process.

RLVRR has an LLM write small Python functions that check a response's style. Code written by a model
is untrusted, so it never runs in the build's or the trainer's process. `run_checks` starts a fresh
interpreter for a batch of checks and texts; what holds it back, honestly:

- OS-enforced: CPU time (RLIMIT_CPU: `seconds` per call, for the whole child, then SIGXCPU), address
  space (RLIMIT_AS: `memory_mb`; a big allocation raises MemoryError), no file writes (RLIMIT_FSIZE 0),
  no new processes (RLIMIT_NPROC 0; Linux does not apply it to root), no core dumps, and a wall clock
  kept by the parent, which kills the child. The child's environment is empty (no API keys, no
  proxies), its working folder an empty temporary one, and `python -I -S` reads no site or user paths.
- Network: with `network='namespace'` (what 'auto' picks where `unshare -rn` works: Linux with
  unprivileged user namespaces) the child runs in a new network namespace with no interfaces, not even
  loopback: nothing can be reached, whatever the code does. Everywhere, the child also blocks it at the
  Python level: `socket`, `ssl`, `select` and the like cannot be imported.
- Python-level, and escapable by a determined author: a check sees only safe builtins (no `open`,
  `exec`, `eval`, `getattr`, ...) and may import only a few pure modules (re, math, string, json, ...);
  each call is interrupted after `seconds` by an alarm. Introspection (`().__class__.__subclasses__()`)
  can get around these; the OS limits above still hold. This is containment of buggy or careless code,
  not a security boundary against a hostile one: use a container or a VM for that.

A check is source code defining `check(response: str) -> float | bool` (or the function named by its
`name`): 1 / True for a response with the property, 0 / False without, a fraction in between. Anything
else (an exception, a timeout, a value outside [0, 1]) is an error of that call, with what happened.

`row_code` runs a row's `style_code` checks (what `python -m nanogrpo.reward_data style --python-checks`
writes) on a completion, as a style user check of the trainer, still in a child process:

    python train.py --reward.spec keywords:0.5,style:0.5 --reward.allow-user-code \\
        --reward.style-user-checks nanogrpo.reward_data.sandbox.row_code \\
        --reward.style-weights length:1,row_code:1

One child per completion: about 20-40 ms each on a CPU, so some seconds per step of a large batch.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

NETWORKS = ("auto", "namespace", "python")
ALLOWED_IMPORTS = ("re", "math", "string", "json", "collections", "itertools", "functools", "statistics",
                   "unicodedata", "textwrap", "difflib", "fractions", "decimal", "operator")  # fmt: skip

# The child: sets its own limits first (no preexec_fn: it is unsafe in a threaded parent such as a
# trainer), then blocks the network modules, then runs each check under an alarm with safe builtins.
CHILD = r"""
import builtins, json, math, resource, signal, sys
job = json.loads(sys.stdin.read())
mem = job["memory_mb"] << 20
cpu = max(1, math.ceil(job["cpu_s"]))
for what, soft, hard in ((resource.RLIMIT_AS, mem, mem), (resource.RLIMIT_CPU, cpu, cpu + 1),
                         (resource.RLIMIT_FSIZE, 0, 0), (resource.RLIMIT_NPROC, 0, 0), (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(what, (soft, hard))  # CPU: SIGXCPU at the soft limit, SIGKILL a second later
for name in ("socket", "_socket", "ssl", "_ssl", "select", "selectors", "subprocess", "_posixsubprocess",
             "multiprocessing", "ctypes", "_ctypes", "asyncio", "http", "urllib", "ftplib", "smtplib"):
    sys.modules[name] = None  # `import socket` now raises ImportError, whoever imports it
ALLOWED = set(job["allowed"])
_import = builtins.__import__
def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level or name.split(".")[0] not in ALLOWED:
        raise ImportError(f"import of {name!r} is not allowed in a style check (allowed: {', '.join(sorted(ALLOWED))})")
    return _import(name, globals, locals, fromlist, level)
DENY = {"open", "exec", "eval", "compile", "input", "breakpoint", "globals", "locals", "vars", "getattr",
        "setattr", "delattr", "help", "exit", "quit", "memoryview", "__import__", "__loader__", "__spec__"}
safe = {k: v for k, v in vars(builtins).items() if k not in DENY}
safe["__import__"] = guarded_import
class Timeout(BaseException):
    pass
def alarm(signum, frame):
    raise Timeout()
signal.signal(signal.SIGALRM, alarm)
class Sink:
    def write(self, s):
        return len(s)
    def flush(self):
        pass
out = sys.stdout
sys.stdout = sys.stderr = Sink()  # a check's prints go nowhere: stdout carries the results
def why(e):
    if isinstance(e, Timeout):
        return f"timed out after {job['seconds']:g} s"
    if isinstance(e, MemoryError):
        return f"ran out of memory (limit {job['memory_mb']} MB)"
    return f"{type(e).__name__}: {e}"[:300]
results = []
for check in job["checks"]:
    ns = {"__builtins__": safe, "__name__": "style_check"}
    fn, err = None, ""
    try:
        signal.setitimer(signal.ITIMER_REAL, job["seconds"])
        exec(compile(check["code"], f"<check {check['name']}>", "exec"), ns)
        signal.setitimer(signal.ITIMER_REAL, 0)
        fn = ns.get(check["name"]) or ns.get("check")
        if not callable(fn):
            err = f"the code defines no function {check['name']!r} or 'check'"
    except BaseException as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        err = "defining it: " + why(e)
    row = []
    for text in job["texts"]:
        if err:
            row.append({"error": err})
            continue
        try:
            signal.setitimer(signal.ITIMER_REAL, job["seconds"])
            v = fn(text)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as e:
            signal.setitimer(signal.ITIMER_REAL, 0)
            row.append({"error": why(e)})
            continue
        if isinstance(v, bool) or (type(v) in (int, float) and v == v and 0 <= v <= 1):
            row.append({"score": float(v)})
        else:
            row.append({"error": f"returned {repr(v)[:60]}, not a score in [0, 1] or a bool"})
    results.append(row)
out.write(json.dumps(results))
out.flush()
"""


@dataclass(frozen=True)
class Limits:
    """What a child may spend: `seconds` of CPU per call (the child's total is seconds x calls + 1) and
    `memory_mb` of address space; `network` 'namespace', 'python' or 'auto' (see the module docstring)."""

    seconds: float = 2.0
    memory_mb: int = 256
    network: str = "auto"


@functools.cache
def namespace_works() -> bool:
    """Whether `unshare -rn` can start a process here (unprivileged user and network namespaces)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _command(network: str) -> list[str]:
    if network not in NETWORKS:
        raise ValueError(f"the sandbox's network mode must be one of {', '.join(NETWORKS)}, got {network!r}")
    if network == "namespace" and not namespace_works():
        raise ValueError(
            "network mode 'namespace' needs `unshare -rn` (Linux with unprivileged user namespaces), which "
            "fails here; use 'python' (socket modules blocked, escapable) or run the build in a container"
        )
    use_ns = network == "namespace" or (network == "auto" and namespace_works())
    return (["unshare", "-rn"] if use_ns else []) + [sys.executable, "-I", "-S", "-c", CHILD]


def _killed(returncode: int, limits: Limits, cpu: float, wall: float, timed_out: bool) -> str:
    if timed_out:
        return f"the sandbox was killed after {wall:g} s of wall-clock time"
    if returncode == -24:  # SIGXCPU: a computation no alarm could interrupt (a long call into C)
        return f"the sandbox hit its CPU time limit ({cpu:g} s in all, {limits.seconds:g} s per call)"
    if returncode == -9:
        return f"the sandbox was killed (memory limit {limits.memory_mb} MB, or CPU time)"
    return f"the sandbox failed (exit {returncode})"


def run_checks(
    checks: list[dict[str, str]], texts: list[str], limits: Limits = Limits()
) -> list[list[dict[str, Any]]]:
    """results[i][j]: {"score": s} or {"error": why} of check i ({"name", "code"}) on text j, every call
    run in one child process. A child killed by a limit gives every call the error saying which."""
    if not checks or not texts:
        return [[] for _ in checks]
    if not (limits.seconds > 0 and math.isfinite(limits.seconds)) or limits.memory_mb < 32:
        raise ValueError(
            "sandbox limits: seconds must be > 0 and memory_mb >= 32 (Python itself needs ~20 MB)"
        )
    calls = len(checks) * (len(texts) + 1)  # defining each check counts as a call
    cpu = limits.seconds * calls + 1.0
    job = {"checks": [{"name": c["name"], "code": c["code"]} for c in checks], "texts": texts,
           "seconds": limits.seconds, "memory_mb": limits.memory_mb, "cpu_s": cpu,
           "allowed": list(ALLOWED_IMPORTS)}  # fmt: skip
    wall = 2 * cpu + 5.0  # start-up and a child that sleeps rather than computes
    timed_out = False
    with tempfile.TemporaryDirectory(prefix="nanogrpo-check-") as cwd:
        try:
            proc = subprocess.run(_command(limits.network), input=json.dumps(job), capture_output=True,
                                  text=True, timeout=wall, cwd=cwd, env={"LANG": "C.UTF-8"})  # fmt: skip
            returncode, stdout = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired:
            returncode, stdout, timed_out = -9, "", True
    if returncode == 0:
        try:
            got = json.loads(stdout)
            if isinstance(got, list) and len(got) == len(checks):
                return got
        except ValueError:
            pass
    why = _killed(returncode, limits, math.ceil(cpu), wall, timed_out)
    return [[{"error": why} for _ in texts] for _ in checks]


def read_code_checks(value: Any) -> list[tuple[str, str, float]]:
    """A row's `style_code` -> [(name, code, weight)]; ValueError saying what is wrong."""
    if not isinstance(value, list) or not value:
        raise ValueError('must be a non-empty list of {"name": str, "code": str, "weight": number}')
    out = []
    for k, c in enumerate(value):
        name, code, w = (
            (c.get("name"), c.get("code"), c.get("weight", 1.0)) if isinstance(c, dict) else (None,) * 3
        )
        if not (isinstance(name, str) and name.isidentifier() and isinstance(code, str) and code.strip()):
            raise ValueError(f'item {k} needs "name" (a Python identifier) and "code" (source text)')
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
            raise ValueError(f"item {k} ('{name}'): weight must be a number >= 0, got {w!r}")
        out.append((name, code, float(w)))
    return out


def row_code(completion: str, reference: str, row: dict[str, Any]) -> float | None:
    """A style user check: the weighted mean of the row's `style_code` checks on the completion, each run
    in the sandbox with the default Limits; a call that fails scores 0. None when the row has none."""
    if row.get("style_code") is None:
        return None
    checks = read_code_checks(row["style_code"])
    if not any(w > 0 for *_, w in checks):
        return None
    res = run_checks([{"name": n, "code": c} for n, c, _ in checks], [completion])
    scores = [r[0].get("score", 0.0) for r in res]
    return sum(s * w for s, (*_, w) in zip(scores, checks)) / sum(w for *_, w in checks)
