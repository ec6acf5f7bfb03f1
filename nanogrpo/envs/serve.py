"""What runs in an environment's worker process (envs/workers.py has the whole picture): one instance served at
a time, and every request answered with plain data made and checked here, so that nothing the environment
returns reaches the trainer as anything but JSON.

    serve(sock, factory)     # requests: (number, op, arg), pickled by the trainer; replies: JSON naming the number

- An observation is made text (str(), lone surrogates replaced, cut at the budget); a reward a finite float
  (a number: '1' is not one); `done` and info['invalid'] bools; info what JSON can write, within INFO_CHARS
  of text and INFO_NODES values (a dict that holds itself is written as far as that, in milliseconds).
- Whatever the environment raises (SystemExit and KeyboardInterrupt too) is the call's error, one line.
- A fork the environment made that returns from the call into this loop is not the worker: it ends, silent.
- An episode's timers end with it (quiet_timers): the next instance is not killed by the last one's alarm.
"""

from __future__ import annotations

import gc
import json
import math
import numbers
import os
import pickle
import signal
import socket
import struct
import sys
import traceback
from typing import Any

from nanogrpo.envs import protocol_attrs

INFO_CHARS = 20_000
"""The most characters of text an episode's `info` keeps (strings past it are cut, as are lists and dicts
past 100 entries): info is logged in samples.jsonl with every episode."""
INFO_NODES = 10_000
"""The most values an `info` keeps (past it, '...'): a dict that holds itself, or a deep and wide tree, is
written as far as this, in milliseconds."""


class EnvFault(Exception):
    """Something an environment returned that the episode cannot use; its message is the episode's error."""


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
    the default and unblocked (one pending is dropped first: it was the last episode's). Four system calls when
    nothing was set."""
    untouched = all(signal.getsignal(sig) == signal.SIG_DFL for sig in TIMER_SIGNALS)
    if untouched and not any(any(signal.getitimer(t)) for t in TIMERS) and not signal.sigpending():
        return
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
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the keeper's own handlers are not the environment's
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
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
