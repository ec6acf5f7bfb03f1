"""The keeper: the parent of one environment worker, which runs none of the environment's code and owns every
process the environment starts (envs/workers.py has the whole picture).

    _keeper(ctl, sock, factory, trainer)   # in a process forked from the trainer: forks the worker, then waits

On Linux it is a child subreaper (PR_SET_CHILD_SUBREAPER), so whatever the worker's tree starts, in any session
or process group, double-forked daemons included, stays among its descendants. When the trainer asks (a byte on
`ctl`: a time limit, a death, the run's end) or dies (a pidfd on it; kill -9 included), it kills them all, the
worker's group first, reports how the worker had ended, and exits. The worker's stdout and stderr are a pipe it
reads: what an environment prints reaches the console a line at a time behind `env| `, as printable() shows
it, and no environment process holds the trainer's own streams.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import time
import traceback
import unicodedata
from dataclasses import dataclass

from nanogrpo.envs.serve import _worker


def printable(text: str) -> str:
    """Text as a console may show it: control characters (escape codes, carriage returns, newlines) and the
    bidirectional overrides written as escapes, so that what an environment wrote cannot draw on the terminal,
    rewrite a line, or start one of its own."""
    bidi = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
    return "".join(
        c if c == "\t" or (unicodedata.category(c) != "Cc" and c not in bidi) else ascii(c)[1:-1]
        for c in text
    )


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
