"""Where environments run: each episode's instance in a worker process of its own, so that no environment can
take a run down.

    workers = Workers(factory, limit_s=10.0)
    workers.call({k: ("make", None) for k in range(n)})            # {k: (None, '')}: episode k's instance, built
    workers.call({k: ("reset", (row, seed, max_chars)) ...})      # {k: (first message or None, '')}
    workers.call({k: ("step", (text, max_chars)) ...})            # {k: (Step, '')}, or {k: (None, why)}
    workers.call({k: ("end", None) ...})                          # the instances dropped
    workers.close()                                               # the processes killed (also at exit)

Everything an environment does runs in its worker: the constructor, reset, step, and everything done with
what they return (an observation made text, `info` made what JSON can write, the reward a finite float, `done`
a bool). The trainer receives plain data, or one line saying why the call failed: an exception (SystemExit
included), a result of the wrong shape, a reward that is not finite, the worker's death, or no answer within
the time limit. A worker that overran or died is killed, with every process it started, and replaced; the
episode it hosted ends, the others go on.

Why processes: the time limit must hold whatever the environment does. A timer signal is lost on code that
ignores or blocks it, or swallows the exception it raises in a loop; an abandoned thread keeps running (a busy
one slows the trainer for the rest of the run, one stuck in C holding the GIL stops it, a non-daemon one keeps
the process from exiting). A process can always be killed. What that costs (a round trip per call, a fork per
worker, made once and reused) is measured in docs/ENVS.md.

Workers are forked from the trainer: they inherit the factory as it is (nothing is pickled) and start in
milliseconds. So an environment must not use the GPU (CUDA does not survive a fork), and class attributes are
each worker's own copy, carried from one episode to the next in that worker only: an episode's state belongs
on its instance (docs/ENVS.md). Workers are Linux and macOS processes; they die with the trainer (on Linux
even when it is killed with SIGKILL: the kernel sends them SIGKILL too).
"""

from __future__ import annotations

import gc
import math
import os
import signal
import socket
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from nanogrpo.envs import Step, protocol_attrs

MIN_TIMEOUT_S = 0.01
"""The smallest time limit that can work (--env.step-timeout-s): a call's round trip to its worker takes
0.1-0.3 ms on an idle 2-core machine and a few ms when the machine is busy (docs/ENVS.md)."""
INFO_CHARS = 20_000
"""The most characters of text an episode's `info` keeps (strings past it are cut, as are lists and dicts
past 100 entries): info is logged in samples.jsonl with every episode."""


class EnvFault(Exception):
    """Something an environment returned that the episode cannot use; its message is the episode's error."""


# -- in the worker ---------------------------------------------------------------------------------------


def clean_text(x: Any, max_chars: int) -> str:
    """x as text the tokenizer takes: str() of anything that is not text, lone surrogates replaced, and cut
    at max_chars (before the tokenizer reads it: a 10 MB observation is not tokenized whole)."""
    s = x if isinstance(x, str) else str(x)
    s = s[:max_chars]
    return s.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate (which tokenizers refuse) -> '?'


def as_flag(x: Any, what: str) -> bool:
    """A true/false value as a bool: a bool, an int, None (False), or a one-element NumPy / torch value."""
    if hasattr(x, "item") and getattr(x, "size", 1) in (1, ()) and callable(x.item):
        x = x.item()  # a NumPy scalar or one-element array, a torch scalar
    if x is None or isinstance(x, (bool, int)):
        return bool(x)
    raise EnvFault(f"{what} must be True or False, got {type(x).__name__}")


def as_json(x: Any, budget: list[int], depth: int = 0) -> Any:
    """x as far as JSON can write it: text, finite numbers (NaN and inf as null), bools, None, lists and dicts
    with text keys; anything else as its text (its type's name if even that fails). `budget` holds the
    characters of text left: past it, strings are cut to '...'."""
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, int):
        return x if abs(x) < 2**63 else str(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "tolist") and callable(x.tolist) and not isinstance(x, (str, dict)):
        try:  # NumPy arrays and scalars, tensors
            return as_json(x.tolist(), budget, depth)
        except Exception:
            pass
    if depth < 8 and isinstance(x, dict):
        return {clean_text(k, 200): as_json(v, budget, depth + 1) for k, v in list(x.items())[:100]}
    if depth < 8 and isinstance(x, (list, tuple, set, frozenset)):
        return [as_json(v, budget, depth + 1) for v in list(x)[:100]]
    try:
        s = clean_text(x, max(0, budget[0]))
    except Exception:
        s = f"<{type(x).__name__}>"
    budget[0] -= len(s)
    return s if budget[0] > 0 else s + "..."


def plain_step(res: Any, max_chars: int) -> Step:
    """What a step returned, checked and made plain: a Step of text (or None), a finite float reward, a bool
    done and a JSON-safe info dict; EnvFault saying what is wrong otherwise."""
    if not (hasattr(res, "reward") and hasattr(res, "done")):
        raise EnvFault(f"step returned {type(res).__name__}, not a Step(observation, reward, done, info)")
    try:
        reward = float(res.reward)
    except Exception:
        raise EnvFault(f"step returned the reward {type(res.reward).__name__}, not a number") from None
    if not math.isfinite(reward):
        raise EnvFault(f"step returned the reward {reward}, not a finite number")
    done = as_flag(res.done, "done")
    raw = getattr(res, "info", None)
    raw = {} if raw is None else raw if isinstance(raw, dict) else {"info": raw}
    invalid = as_flag(raw.get("invalid"), "info['invalid']")
    info = as_json(raw, [INFO_CHARS])
    if "invalid" in raw:
        info["invalid"] = invalid
    obs = getattr(res, "observation", None)
    return Step(None if obs is None else clean_text(obs, max_chars), reward, done, info)


def first_message(message: Any, max_chars: int) -> str | None:
    """What reset returned: None (the row's own prompt) or text; EnvFault otherwise."""
    if message is None:
        return None
    if not isinstance(message, str):
        raise EnvFault(f"reset returned {type(message).__name__}, not str or None")
    return clean_text(message, max_chars)


def describe(e: BaseException) -> str:
    """One line for an exception, even one whose message cannot be read."""
    try:
        msg = str(e)
    except BaseException:
        msg = "(its message could not be read)"
    return msg if isinstance(e, EnvFault) else f"{type(e).__name__}: {msg}"


def serve(conn: Connection, factory) -> None:
    """The worker's loop: one request at a time, one reply each, until the trainer closes its end."""
    env = None
    while True:
        try:
            op, arg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op == "make":  # a fresh instance for the next episode; the last one's goes first
                env = None
                env, out = factory(), None
            elif op == "reset":
                row, seed, max_chars = arg
                out = first_message(env.reset(row, seed), max_chars)
            elif op == "step":
                text, max_chars = arg
                out = plain_step(env.step(text), max_chars)
            elif op == "attrs":  # the protocol's attributes, checked (at start-up)
                try:
                    out = protocol_attrs(env)
                except ValueError as e:
                    raise EnvFault(str(e)) from None
            else:  # "end": the episode is over
                env, out = None, None
            reply = ("ok", out)
        except BaseException as e:  # whatever an environment raises, SystemExit and KeyboardInterrupt too
            if os.environ.get("NANOGRPO_DEBUG"):
                traceback.print_exc()
            reply = ("error", f"{op}: {describe(e)}"[:400])
        conn.send(reply)


def _worker(conn: Connection, factory, parent: int) -> None:
    """A forked worker's start: its own process group (killed with whatever it starts), Ctrl-C left to the
    trainer, dead with the trainer, one torch thread (OpenMP's pool does not survive a fork)."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:  # Linux: SIGKILL when the trainer dies, however it dies
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the trainer died before the line above
        return
    gc.enable()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    serve(conn, factory)


# -- in the trainer --------------------------------------------------------------------------------------


@dataclass
class Proc:
    """One worker process, seen from the trainer."""

    pid: int
    conn: Connection


def fork_worker(factory) -> Proc:
    """A worker forked from this process, serving `factory`'s instances."""
    sys.stdout.flush()  # what is buffered now would be written twice: once by the worker
    sys.stderr.flush()
    ours, theirs = socket.socketpair()
    parent = os.getpid()
    gc.freeze()  # the worker's collector leaves the trainer's objects alone: their pages stay shared
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            ours.close()
            _worker(Connection(theirs.detach()), factory, parent)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    gc.unfreeze()
    theirs.close()
    try:  # set here too, so that a kill right after the fork reaches its group
        os.setpgid(pid, pid)
    except OSError:
        pass
    return Proc(pid, Connection(ours.detach()))


def kill(proc: Proc, grace_s: float = 0.0) -> str:
    """Kill a worker and every process in its group, and reap it. `grace_s`: time it is given to end on its own
    first (one that closed its pipe is on its way out). Returns how it had ended ('exit code 1', 'signal 11'),
    '' when it was killed here."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            pid, code = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already
            pid, code = proc.pid, 0
        if pid:
            status = os.waitstatus_to_exitcode(code)
            proc.conn.close()
            return f"exit code {status}" if status >= 0 else f"signal {-status}"
        if time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    for send in (os.killpg, os.kill):
        try:
            send(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.waitpid(proc.pid, 0)
    except ChildProcessError:
        pass
    proc.conn.close()
    return ""


def _kill_all(procs: list) -> None:
    for i, p in enumerate(procs):
        if p is not None:
            kill(p)
            procs[i] = None


class Workers:
    """The worker processes of one environment factory: worker k hosts episode k of a rollout, one episode at a
    time, a fresh instance each. Forked when first needed and reused; killed at close, when this object is
    garbage-collected, or at exit."""

    def __init__(self, factory, limit_s: float, parallel: int = 0):
        self.factory, self.limit_s = factory, limit_s
        self.parallel = parallel or max(2, os.cpu_count() or 2)  # calls in flight at once
        self.procs: list[Proc | None] = []
        self._finalize = weakref.finalize(self, _kill_all, self.procs)

    def grow(self, n: int) -> None:
        """Fork the workers 0..n-1 that are not running (at start-up: before the model loads, forks are cheap)."""
        self.procs.extend([None] * (n - len(self.procs)))
        for k in range(n):
            if self.procs[k] is None:
                self.procs[k] = fork_worker(self.factory)

    def call(self, requests: dict[int, tuple[str, Any]]) -> dict[int, tuple[Any, str]]:
        """Send request (op, arg) to worker k for each k, at most `parallel` at a time, each answered within
        the time limit: {k: (value, '')}, or {k: (None, why it failed)} (the worker killed and forked anew
        when it overran or died)."""
        if requests:
            self.grow(max(requests) + 1)
        out: dict[int, tuple[Any, str]] = {}
        queue = sorted(requests.items())
        running: dict[Connection, tuple[int, str, float]] = {}  # conn -> (k, op, deadline)
        while queue or running:
            while queue and len(running) < self.parallel:
                k, (op, arg) = queue.pop(0)
                proc = self.procs[k]
                assert proc is not None
                try:
                    proc.conn.send((op, arg))
                except OSError:  # it died between calls (a thread of the environment's ended it)
                    out[k] = (None, f"{op}: the environment's process had died ({self._restart(k, 1.0)})")
                    continue
                running[proc.conn] = (k, op, time.monotonic() + self.limit_s if self.limit_s else math.inf)
            if not running:
                continue
            nearest = min(d for _, _, d in running.values())
            timeout = None if nearest == math.inf else max(0.0, nearest - time.monotonic())
            for conn in wait(list(running), timeout):
                k, op, _ = running.pop(conn)  # type: ignore[index]
                try:
                    status, value = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):  # it died in the call: os._exit, a crash, a signal
                    out[k] = (
                        None,
                        f"{op}: the environment's process died ({self._restart(k, 1.0) or 'killed'})",
                    )
                    continue
                out[k] = (value, "") if status == "ok" else (None, value)
            now = time.monotonic()
            for conn, (k, op, deadline) in list(running.items()):
                if now >= deadline:
                    del running[conn]
                    self._restart(k)
                    out[k] = (None, f"{op}: over {self.limit_s:g} s")
        return out

    def _restart(self, k: int, grace_s: float = 0.0) -> str:
        """Kill worker k and fork a fresh one in its place; how the old one had ended ('' if killed here)."""
        old = self.procs[k]
        status = kill(old, grace_s) if old is not None else ""
        self.procs[k] = fork_worker(self.factory)
        return status

    def close(self) -> None:
        """Kill every worker now (the environments' own clean-up is not waited for)."""
        _kill_all(self.procs)
