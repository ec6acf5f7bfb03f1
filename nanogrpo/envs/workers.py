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

Three processes a worker's life, each with one job:

    trainer --(requests: pickled; replies: JSON, each naming its request)--> worker: serves one instance
       |                                                                       | stdout, stderr
       +--(kill: one byte)--> keeper: the worker's parent; owns all it starts <-+ (shown as `env| ` lines)

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
- Each episode starts clean of the last one's timers: an alarm an episode set and never cancelled is cancelled
  (with the itimers, and the three timer signals' handlers and mask restored) before the next instance is
  built.

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
import numbers
import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
import traceback
import unicodedata
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from nanogrpo.envs import Step, checked_attrs, protocol_attrs

MIN_TIMEOUT_S = 0.01
"""The smallest time limit that can work (--env.step-timeout-s): a call's round trip to its worker takes
0.1-0.3 ms on an idle 2-core machine and a few ms when the machine is busy (docs/ENVS.md)."""
INFO_CHARS = 20_000
"""The most characters of text an episode's `info` keeps (strings past it are cut, as are lists and dicts
past 100 entries): info is logged in samples.jsonl with every episode."""
INFO_NODES = 10_000
"""The most values an `info` keeps (past it, '...'): a dict that holds itself, or a deep and wide tree, is
written as far as this, in milliseconds."""
MAX_REPLY = 16 << 20
"""The longest reply a worker may send, in bytes (its text is cut well below: observations and info)."""
KILL_WAIT_S = 5.0
"""How long the trainer waits for a keeper to kill its worker's processes before it kills the keeper."""


class EnvFault(Exception):
    """Something an environment returned that the episode cannot use; its message is the episode's error."""


def printable(text: str) -> str:
    """Text as a console may show it: control characters (escape codes, carriage returns, newlines) and the
    bidirectional overrides written as escapes, so that what an environment wrote cannot draw on the terminal,
    rewrite a line, or start one of its own."""
    bidi = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
    return "".join(
        c if c == "\t" or (unicodedata.category(c) != "Cc" and c not in bidi) else ascii(c)[1:-1]
        for c in text
    )


# -- the wire: a frame is its length (4 bytes) and its bytes --------------------------------------------------

_LEN = struct.Struct("!I")


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame, read whole (the worker's side, which waits for its next request); None at the end."""
    head = _recv_exactly(sock, _LEN.size)
    return None if head is None else _recv_exactly(sock, _LEN.unpack(head)[0])


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


# -- in the worker ---------------------------------------------------------------------------------------


def clean_text(x: Any, max_chars: int) -> str:
    """x as text the tokenizer takes: str() of anything that is not text, lone surrogates replaced, and cut
    at max_chars (before the tokenizer reads it: a 10 MB observation is not tokenized whole)."""
    s = x if isinstance(x, str) else str(x)
    s = str.__getitem__(s, slice(0, max_chars))  # a str subclass's own slicing is not called
    return s.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate (which tokenizers refuse) -> '?'


def _one_value(x: Any) -> Any:
    """A one-element NumPy or torch value as the Python value it holds; anything else as it is."""
    if hasattr(x, "item") and getattr(x, "size", 1) in (1, ()) and callable(x.item):
        return x.item()
    return x


def as_flag(x: Any, what: str) -> bool:
    """A true/false value as a bool: a bool, an int, None (False), or a one-element NumPy / torch value."""
    x = _one_value(x)
    if x is None or isinstance(x, (bool, int)):
        return bool(x)
    raise EnvFault(f"{what} must be True or False, got {type(x).__name__}")


def as_number(x: Any, what: str) -> float:
    """A reward as a finite float: a real number (bool, int, float, a NumPy or one-element torch value), never
    text ('1' is not 1.0); EnvFault saying what it got otherwise."""
    x = _one_value(x)
    if isinstance(x, (str, bytes)) or not isinstance(x, numbers.Real):
        raise EnvFault(f"{what} {type(x).__name__}, not a number")
    value = float(x)
    if not math.isfinite(value):
        raise EnvFault(f"{what} {value}, not a finite number")
    return value


def as_json(x: Any, budget: list[int], depth: int = 0) -> Any:
    """x as far as JSON can write it: text, finite numbers (NaN and inf as null), bools, None, lists and dicts
    with text keys; anything else as its text (its type's name if even that fails). `budget` holds the
    characters of text and the values left: past the first, strings are cut to '...'; past the second, every
    value is '...'."""
    budget[1] -= 1
    if budget[1] < 0:
        return "..."
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, int):
        return int(x) if abs(x) < 2**63 else str(int(x))
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else None
    try:
        if not isinstance(x, (str, dict)) and callable(getattr(x, "tolist", None)):
            return as_json(x.tolist(), budget, depth)  # NumPy arrays and scalars, tensors
    except Exception:
        pass
    try:
        if depth < 8 and isinstance(x, dict):
            return {_key(k): as_json(v, budget, depth + 1) for k, v in list(dict.items(x))[:100]}
        if depth < 8 and isinstance(x, (list, tuple, set, frozenset)):
            return [as_json(v, budget, depth + 1) for v in list(x)[:100]]
    except Exception:
        pass
    try:
        s = clean_text(x, max(0, budget[0]))
    except Exception:
        s = f"<{type(x).__name__}>"
    budget[0] -= len(s)
    return s if budget[0] > 0 else s + "..."


def _key(k: Any) -> str:
    """A dict key as text (200 characters at most); its type's name when its text fails."""
    try:
        return clean_text(k, 200)
    except Exception:
        return f"<{type(k).__name__}>"


def plain_step(res: Any, max_chars: int) -> dict:
    """What a step returned, checked and made plain data: {observation: text or None, reward: a finite
    float, done: a bool, info: a JSON-safe dict}; EnvFault saying what is wrong otherwise."""
    if not (hasattr(res, "reward") and hasattr(res, "done")):
        raise EnvFault(f"step returned {type(res).__name__}, not a Step(observation, reward, done, info)")
    reward = as_number(res.reward, "step returned the reward")
    done = as_flag(res.done, "done")
    raw = getattr(res, "info", None)
    raw = {} if raw is None else raw if isinstance(raw, dict) else {"info": raw}
    invalid = as_flag(raw.get("invalid"), "info['invalid']")
    info = as_json(raw, [INFO_CHARS, INFO_NODES])
    if "invalid" in raw:
        info["invalid"] = invalid
    obs = getattr(res, "observation", None)
    return {"observation": None if obs is None else clean_text(obs, max_chars), "reward": reward,
            "done": done, "info": info}  # fmt: skip


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


TIMER_SIGNALS = (signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF)
TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)


def quiet_timers() -> None:
    """Cancel what an episode left ticking: an alarm and the interval timers, their signals' handlers back to
    the default and unblocked (one pending is dropped first: it was the last episode's)."""
    for sig in TIMER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # a pending one is discarded
    for timer in TIMERS:
        signal.setitimer(timer, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TIMER_SIGNALS)
    for sig in TIMER_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def answer(op: str, arg: Any, env: Any, factory) -> tuple[Any, Any]:
    """(the instance after `op`, the plain data it answers)."""
    if op == "make":  # a fresh instance for the next episode; the last one's goes first
        quiet_timers()
        return factory(), None
    if op == "reset":
        row, seed, max_chars = arg
        return env, first_message(env.reset(row, seed), max_chars)
    if op == "step":
        text, max_chars = arg
        return env, plain_step(env.step(text), max_chars)
    if op == "attrs":  # the protocol's attributes, checked (at start-up)
        try:
            attrs = protocol_attrs(env)
        except ValueError as e:
            raise EnvFault(str(e)) from None
        return env, attrs
    quiet_timers()  # "end": the episode is over
    return None, None


def serve(sock: socket.socket, factory) -> None:
    """The worker's loop: one request at a time, one reply each, until the trainer closes its end. A reply is
    JSON naming its request; a fork the environment made that comes back here is not the worker: it ends."""
    me, env = os.getpid(), None
    while True:
        try:
            frame = recv_frame(sock)
        except OSError:
            return
        if frame is None:
            return
        rid, op, arg = pickle.loads(frame)  # the trainer's own request
        try:
            if op == "make":
                env = None  # the last episode's instance is dropped before the next is built
            env, out = answer(op, arg, env, factory)
            reply = {"id": rid, "ok": True, "value": out}
        except BaseException as e:  # whatever an environment raises, SystemExit and KeyboardInterrupt too
            if os.environ.get("NANOGRPO_DEBUG"):
                traceback.print_exc()
            reply = {"id": rid, "ok": False, "error": clean_text(f"{op}: {describe(e)}", 400)}
        if os.getpid() != me:  # the environment forked and its child returned from the call
            os._exit(0)
        try:
            payload = json.dumps(reply, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError, UnicodeError) as e:  # not plain data after all: the call failed
            payload = json.dumps(
                {"id": rid, "ok": False, "error": f"{op}: a reply JSON cannot write ({e})"[:400]}
            )
            payload = payload.encode("utf-8")
        try:
            send_frame(sock, payload)
        except OSError:
            return


def _worker(sock: socket.socket, out_fd: int, factory, keeper: int) -> None:
    """A forked worker's start: its own process group, stdout and stderr into the keeper's pipe (line by
    line), no stdin, Ctrl-C left to the trainer, dead with its keeper, one torch thread (OpenMP's pool does not
    survive a fork)."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _on_parent_death(signal.SIGKILL)
    if os.getppid() != keeper:  # the keeper died before the line above
        return
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(null)
    os.close(out_fd)
    sys.stdout, sys.stderr = (
        open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
        for fd in (1, 2)
    )  # line by line into the pipe (the trainer's streams were flushed before the fork)
    gc.enable()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    serve(sock, factory)


def _on_parent_death(sig: int) -> bool:
    """Linux: `sig` to this process when its parent dies, however it dies (PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        return ctypes.CDLL(None).prctl(1, sig) == 0
    except (OSError, AttributeError):
        return False


# -- the keeper ------------------------------------------------------------------------------------------


class _Stop(Exception):
    """SIGTERM or SIGHUP reached the keeper: it ends as when the trainer asks."""


def _raise_stop(signum, frame) -> None:
    raise _Stop


def _keeper(ctl: socket.socket, sock: socket.socket, factory, trainer: int) -> None:
    """The keeper's life: fork the worker, forward what it prints, and when the trainer asks (a byte on `ctl`)
    or dies, kill every process the worker started and report how the worker had ended."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGHUP, _raise_stop)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of the worker's tree come here
    except (OSError, AttributeError):
        pass
    try:
        watch = [os.pidfd_open(trainer)]  # readable when the trainer exits
    except (AttributeError, OSError):
        watch = []  # macOS: its parent is looked at every second
    if os.getppid() != trainer:
        return
    out_r, out_w = os.pipe()
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            ctl.close()
            os.close(out_r)
            for fd in watch:
                os.close(fd)
            _worker(sock, out_w, factory, me)
        except BaseException:  # nanogrpo's own fault, not the environment's (serve catches those): shown
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    sock.close()
    os.close(out_w)
    shown = Lines()
    status = ""  # how the worker ended, once it has
    grace = 0.0
    try:
        ctl.sendall(struct.pack("!i", pid))
        while True:
            ready = select.select([ctl, *watch, *([out_r] if out_r >= 0 else [])], [], [], 1.0)[0]
            status = _reap(pid, status)
            if out_r in ready:
                chunk = os.read(out_r, 1 << 16)
                if chunk:
                    shown.feed(chunk)
                else:
                    os.close(out_r)
                    out_r = -1
            if ctl in ready:
                msg = ctl.recv(16)
                if len(msg) >= 5:
                    grace = struct.unpack("!f", msg[1:5])[0]
                break
            if watch and any(fd in ready for fd in watch) or os.getppid() != trainer:
                break
    except (_Stop, OSError):
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    deadline = time.monotonic() + grace  # the worker's time to end on its own (one that closed its socket)
    while not status and time.monotonic() < deadline:
        time.sleep(0.005)
        status = _reap(pid, status)
    kill_tree(pid)
    if out_r >= 0:  # what the worker printed before it was killed
        while select.select([out_r], [], [], 0)[0] and (chunk := os.read(out_r, 1 << 16)):
            shown.feed(chunk)
    shown.flush()
    try:
        ctl.sendall(status.encode() + b"\n")
    except OSError:
        pass


def _reap(worker: int, status: str) -> str:
    """Reap the keeper's children that have ended (the worker, or the orphans of its tree); the worker's end
    as text ('exit code 5', 'signal 11') once it has ended, `status` until then."""
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if not pid:
            return status
        if pid == worker:
            c = os.waitstatus_to_exitcode(code)
            status = f"exit code {c}" if c >= 0 else f"signal {-c}"


def kill_tree(worker: int) -> None:
    """Kill the worker's process group, then every descendant of the keeper until none is left (a subreaper:
    each orphan comes back as its child), reaping them all."""
    try:
        os.killpg(worker, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 10.0  # a process stuck in the kernel (D state) is not waited for longer
    while time.monotonic() < deadline:
        kids = descendants(os.getpid())
        for p in kids:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:  # no child left, and so (a subreaper) no descendant
            if not kids:
                return
        time.sleep(0.002)


def descendants(root: int) -> list[int]:
    """The processes below `root` (Linux: read from /proc; elsewhere its children are not listed: [])."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # after the command's name, which may hold ')'
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


@dataclass
class Lines:
    """What a worker prints, written to the console a whole line at a time behind `env| `, as printable()."""

    buf: bytes = b""
    most: int = 4000  # characters of one line shown

    def feed(self, chunk: bytes) -> None:
        *whole, self.buf = (self.buf + chunk).split(b"\n")
        for line in whole:
            self._show(line)

    def flush(self) -> None:
        if self.buf:
            self._show(self.buf)
            self.buf = b""

    def _show(self, line: bytes) -> None:
        text = printable(line.decode("utf-8", "replace")[: self.most])
        try:
            os.write(2, f"env| {text}\n".encode("utf-8", "replace"))
        except OSError:
            pass


# -- in the trainer --------------------------------------------------------------------------------------


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
    proc = Proc(pid, ours, ctl_ours)
    got = _recv_exactly(ctl_ours, 4)  # the keeper says the worker's pid once it has forked it
    proc.worker = struct.unpack("!i", got)[0] if got else 0
    return proc


def _ask_to_end(proc: Proc, grace_s: float) -> None:
    try:
        proc.ctl.sendall(b"k" + struct.pack("!f", grace_s))
    except OSError:
        pass


def _collect(proc: Proc, wait_s: float = KILL_WAIT_S) -> str:
    """The keeper's report after _ask_to_end (how the worker had ended, '' when it was killed), the keeper
    reaped; a keeper that does not answer in `wait_s` is killed, and the worker's group with it."""
    report = b""
    deadline = time.monotonic() + wait_s
    while not report.endswith(b"\n"):
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
    if not report.endswith(b"\n"):
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
    return report.decode("utf-8", "replace").strip()


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


class BadReply(Exception):
    """A reply that is not what a worker sends (not JSON, too long): the worker is treated as broken."""


def read_replies(proc: Proc) -> list[dict] | None:
    """The whole replies that have come from a worker (read as far as they have come, never waiting); None
    when its socket has closed (the worker died). BadReply for bytes no worker sends."""
    while True:
        try:
            chunk = proc.sock.recv(1 << 16)
        except BlockingIOError:
            break
        except OSError:
            return None
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
                    proc.sock.setblocking(True)
                    send_frame(proc.sock, pickle.dumps((proc.sent, op, arg)))
                    proc.sock.setblocking(False)
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
