"""Where environments run: each episode's instance in a worker process of its own, so that no environment can
take a run down.

    workers = Workers(factory, limit_s=10.0)
    workers.call({k: ("make", None) for k in range(n)})            # {k: (None, '')}: episode k's instance, built
    workers.call({k: ("attrs", None)})                            # {k: (its protocol attributes, '')} (start-up)
    workers.call({k: ("reset", (row, seed, max_chars)) ...})      # {k: (first message or None, '')}
    workers.call({k: ("step", (text, max_chars)) ...})            # {k: (Step, '')}, or {k: (None, why)}
    workers.call({k: ("end", None) ...})                          # the instances dropped
    workers.close()                                               # the processes killed (also at exit)

Everything an environment does runs in its worker: the constructor (a TRL-style class's inspection too),
reset, step, and everything done with what they return (an observation made text, `info` made what JSON can
write, the reward a finite number, `done` a bool). The trainer receives plain data, or one line saying why the
call failed: an exception (SystemExit included), a result of the wrong shape, a reward that is not finite, the
worker's death, or no answer within the time limit. A worker that overran or died is killed, with every
process it started, and replaced; the episode it hosted ends, the others go on.

Why processes: the time limit must hold whatever the environment does. A timer signal is lost on code that
ignores or blocks it, or swallows the exception it raises in a loop; an abandoned thread keeps running (a busy
one slows the trainer for the rest of the run, one stuck in C holding the GIL stops it, a non-daemon one keeps
the process from exiting). A process can always be killed. What that costs (a round trip per call, two forks
per worker, made once and reused) is measured in docs/ENVS.md.

Three processes a worker's life, each with one job (this file is the trainer's side):

    trainer --(requests: pickled; replies: JSON, each naming its request)--> worker: serves one instance
       |                                                                     (serve.py) | stdout, stderr
       +--(kill: one byte)--> keeper (keeper.py): the worker's parent; owns all it starts <-+ (`env| ` lines)

- The reply is plain data, made and checked in the worker: JSON (text with every lone surrogate replaced,
  finite numbers), read in the trainer by json.loads, which runs no code. It carries its request's number: a
  second or stray reply (a fork of the worker that went on serving) is dropped and named, never taken for the
  next call's. A reply is read as its bytes come, never by a blocking read, so the time limit holds there too.
- The keeper runs none of the environment's code. It is the worker's parent and, on Linux, a child subreaper
  (PR_SET_CHILD_SUBREAPER): whatever the environment starts, in any session or process group, double-forked
  daemons included, stays among its descendants. When the trainer asks (a time limit, a death, the run's end),
  or when the trainer dies (a pidfd on it: kill -9 included), it kills them all, the worker first, and exits.
- The worker's stdout and stderr are a pipe the keeper reads: an environment's processes never hold the
  trainer's own (so `train.py | tee log` returns when the run ends), and what they print reaches the console
  one line at a time, behind `env| `, its control characters shown as escapes (no escape code, no fake
  `error:` line).
- Each episode ends clean of its timers: an alarm it set and never cancelled is cancelled (with the interval
  timers, and the three timer signals' handlers and mask restored) when it ends, and again before the next
  instance is built.

Workers are forked from the trainer: they inherit the factory as it is (nothing is pickled) and start in
milliseconds. So an environment must not use the GPU (CUDA does not survive a fork), and class attributes are
each worker's own copy, carried from one episode to the next in that worker only: an episode's state belongs
on its instance (docs/ENVS.md). Workers are Linux and macOS processes; on macOS, which has no subreaper, what
an environment starts in a session of its own is not tracked.
"""

from __future__ import annotations

import gc
import json
import math
import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from nanogrpo.envs import Step, checked_attrs
from nanogrpo.envs.keeper import _keeper
from nanogrpo.envs.serve import _LEN

MIN_TIMEOUT_S = 0.01
"""The smallest time limit that can work (--env.step-timeout-s): a call's round trip to its worker takes
0.1-0.3 ms on an idle 2-core machine and a few ms when the machine is busy (docs/ENVS.md)."""
MAX_REPLY = 16 << 20
"""The longest reply a worker may send, in bytes (its text is cut well below: observations and info)."""
KILL_WAIT_S = 5.0
"""How long the trainer waits for a keeper to kill its worker's processes before it kills the keeper."""


@dataclass(eq=False)
class Proc:
    """One worker, seen from the trainer: its keeper's pid, the worker's socket and pid, the keeper's
    control socket, the reply bytes read so far and the number of the last request."""

    pid: int
    sock: socket.socket
    ctl: socket.socket
    worker: int = 0
    buf: bytearray = field(default_factory=bytearray)
    sent: int = 0

    def fileno(self) -> int:
        return self.sock.fileno()


def fork_worker(factory) -> Proc:
    """A worker (and its keeper) forked from this process, serving `factory`'s instances."""
    sys.stdout.flush()  # what is buffered now would be written twice: once by the keeper
    sys.stderr.flush()
    ours, theirs = socket.socketpair()
    ctl_ours, ctl_theirs = socket.socketpair()
    parent = os.getpid()
    gc.freeze()  # the children's collectors leave the trainer's objects alone: their pages stay shared
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            ours.close()
            ctl_ours.close()
            _keeper(ctl_theirs, theirs, factory, parent)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    gc.unfreeze()
    theirs.close()
    ctl_theirs.close()
    ours.setblocking(False)
    return Proc(pid, ours, ctl_ours)  # the keeper forks the worker meanwhile (its first reply waits for it)


def _ask_to_end(proc: Proc, grace_s: float) -> None:
    try:
        proc.ctl.sendall(b"k" + struct.pack("!f", grace_s))
    except OSError:
        pass


def _collect(proc: Proc, wait_s: float = KILL_WAIT_S) -> str:
    """The keeper's report after _ask_to_end (how the worker had ended, '' when it was killed), the keeper
    reaped; a keeper that does not answer in `wait_s` is killed, and the worker's group with it."""
    report = b""  # the worker's pid (4 bytes, sent once it was forked), then how it ended and a newline
    deadline = time.monotonic() + wait_s
    while len(report) <= 4 or not report.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.ctl], [], [], left)[0]:
            break
        try:
            chunk = proc.ctl.recv(256)
        except OSError:
            break
        if not chunk:
            break
        report += chunk
    proc.worker = struct.unpack("!i", report[:4])[0] if len(report) >= 4 else 0
    if len(report) <= 4 or not report.endswith(b"\n"):
        for pid, send in ((proc.pid, os.kill), (proc.worker, os.killpg)):
            try:
                if pid:
                    send(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        os.waitpid(proc.pid, 0)
    except ChildProcessError:
        pass
    proc.sock.close()
    proc.ctl.close()
    return report[4:].decode("utf-8", "replace").strip()


def kill(proc: Proc, grace_s: float = 0.0) -> str:
    """Kill a worker and every process it started, and its keeper. `grace_s`: time the worker is given to end
    on its own first (one that closed its socket is on its way out). Returns how it had ended ('exit code 1',
    'signal 11'), '' when it was killed here."""
    _ask_to_end(proc, grace_s)
    return _collect(proc, grace_s + KILL_WAIT_S)


def _kill_all(procs: list) -> None:
    """Every worker killed, all asked at once."""
    live = [(i, p) for i, p in enumerate(procs) if p is not None]
    for _, p in live:
        _ask_to_end(p, 0.0)
    for i, p in live:
        _collect(p)
        procs[i] = None


def send_request(sock: socket.socket, payload: bytes, limit_s: float) -> None:
    """One frame on the trainer's non-blocking socket, within the time limit (a worker reads its requests at
    once; one that does not is past the limit: TimeoutError, an OSError)."""
    data = memoryview(_LEN.pack(len(payload)) + payload)
    deadline = time.monotonic() + (limit_s or math.inf)
    while data:
        try:
            data = data[sock.send(data) :]
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [sock], [], min(left, 3600))[1]:
                raise TimeoutError("the worker does not read its requests") from None


class BadReply(Exception):
    """A reply that is not what a worker sends (not JSON, too long): the worker is treated as broken."""


def read_replies(proc: Proc) -> list[dict] | None:
    """The whole replies that have come from a worker (read as far as they have come, never waiting); None
    when its socket has closed (the worker died). BadReply for bytes no worker sends."""
    try:
        chunk = proc.sock.recv(1 << 20)  # what has come (more: the next wait says so)
    except BlockingIOError:
        chunk = None
    except OSError:
        return None
    if chunk is not None:
        if not chunk:
            return None
        proc.buf += chunk
    replies = []
    while len(proc.buf) >= _LEN.size:
        (n,) = _LEN.unpack_from(proc.buf)
        if n > MAX_REPLY:
            raise BadReply(f"a reply of {n} bytes")
        if len(proc.buf) < _LEN.size + n:
            break
        data = bytes(proc.buf[_LEN.size : _LEN.size + n])
        del proc.buf[: _LEN.size + n]
        try:
            reply = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeError, ValueError) as e:
            raise BadReply(f"a reply that is not JSON ({e})") from None
        if not isinstance(reply, dict) or not isinstance(reply.get("id"), int):
            raise BadReply("a reply without its request's number")
        replies.append(reply)
    return replies


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON holds")


def as_value(op: str, value: Any) -> Any:
    """A reply's value as the trainer uses it, its shape checked (the worker made it; this is the trainer not
    trusting the channel): a Step for 'step', tuples in 'attrs'. BadReply when it has the wrong shape."""
    if op == "step":
        ok = (
            isinstance(value, dict)
            and (value.get("observation") is None or isinstance(value.get("observation"), str))
            and isinstance(value.get("reward"), (int, float))
            and not isinstance(value.get("reward"), bool)
            and math.isfinite(value["reward"])
            and isinstance(value.get("done"), bool)
            and isinstance(value.get("info"), dict)
        )
        if not ok:
            raise BadReply("a step reply of the wrong shape")
        return Step(value["observation"], float(value["reward"]), value["done"], value["info"])
    if op == "reset" and not (value is None or isinstance(value, str)):
        raise BadReply("a reset reply that is neither text nor null")
    if op == "attrs":
        try:
            return checked_attrs(value)
        except (ValueError, TypeError, KeyError) as e:
            raise BadReply(f"attributes of the wrong shape ({e})") from None
    return value


class Workers:
    """The worker processes of one environment factory: worker k hosts episode k of a rollout, one episode at a
    time, a fresh instance each. Forked when first needed and reused; killed at close, when this object is
    garbage-collected, or at exit."""

    def __init__(self, factory, limit_s: float, parallel: int = 0):
        self.factory, self.limit_s = factory, limit_s
        self.parallel = parallel or max(2, os.cpu_count() or 2)  # calls in flight at once
        self.procs: list[Proc | None] = []
        self.strays = 0  # replies dropped: to no request, or to one answered already
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
        when it overran, died, or sent what no worker sends)."""
        if requests:
            self.grow(max(requests) + 1)
        out: dict[int, tuple[Any, str]] = {}
        queue = sorted(requests.items())
        running: dict[int, tuple[str, float]] = {}  # k -> (op, deadline)
        while queue or running:
            while queue and len(running) < self.parallel:
                k, (op, arg) = queue.pop(0)
                proc = self.procs[k]
                assert proc is not None
                proc.sent += 1
                try:
                    send_request(proc.sock, pickle.dumps((proc.sent, op, arg)), self.limit_s)
                except OSError:  # it died between calls (a thread of the environment's ended it)
                    out[k] = (None, f"{op}: the environment's process had died ({self._restart(k, 1.0)})")
                    continue
                running[k] = (op, time.monotonic() + self.limit_s if self.limit_s else math.inf)
            if not running:
                continue
            nearest = min(d for _, d in running.values())
            timeout = None if nearest == math.inf else max(0.0, nearest - time.monotonic())
            by_proc = {id(self.procs[k]): k for k in running}
            for proc in wait([self.procs[k] for k in running], timeout):  # type: ignore[misc]
                k = by_proc[id(proc)]
                op, _ = running[k]
                try:
                    replies = read_replies(proc)  # type: ignore[arg-type]
                    if replies is None:  # it died in the call: os._exit, a crash, a signal
                        del running[k]
                        why = self._restart(k, 1.0) or "killed"
                        out[k] = (None, f"{op}: the environment's process died ({why})")
                        continue
                    for reply in replies:
                        if reply["id"] != proc.sent or k in out:  # type: ignore[union-attr]
                            self._stray(k, reply)
                        elif reply.get("ok") is True:
                            out[k] = (as_value(op, reply.get("value")), "")
                        else:
                            out[k] = (None, str(reply.get("error", "")))
                except BadReply as e:
                    out[k] = (None, f"{op}: the environment's process sent {e}")
                    self._restart(k)
                if k in out:
                    running.pop(k, None)
            now = time.monotonic()
            for k, (op, deadline) in list(running.items()):
                if now >= deadline:
                    del running[k]
                    self._restart(k)
                    out[k] = (None, f"{op}: over {self.limit_s:g} s")
        return out

    def _stray(self, k: int, reply: dict) -> None:
        """A reply to no request in flight (a fork of the worker that went on serving): dropped, and named
        the first time."""
        self.strays += 1
        if self.strays == 1:
            print(
                f"note: an environment worker sent a reply to no request in flight (request {reply['id']!r}, "
                f"worker {k}): dropped; an environment that forks and returns from the call in both processes "
                "does this",
                file=sys.stderr,
                flush=True,
            )

    def _restart(self, k: int, grace_s: float = 0.0) -> str:
        """Kill worker k and fork a fresh one in its place; how the old one had ended ('' if killed here)."""
        old = self.procs[k]
        status = kill(old, grace_s) if old is not None else ""
        self.procs[k] = fork_worker(self.factory)
        return status

    def close(self) -> None:
        """Kill every worker now (the environments' own clean-up is not waited for)."""
        _kill_all(self.procs)
