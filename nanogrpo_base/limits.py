"""A call stopped at its time limit: `call_with_limit(fn, limit_s)` runs fn(), and raises Overtime past it.

On the main thread, where no other SIGALRM timer runs (train.py, eval.py), a timer signal interrupts the call
where it is: Overtime is a BaseException, so the callee's own `except Exception` does not swallow it, and the
timer repeats each second, so a bare `except:` that swallows one gets another. Elsewhere (another thread, or a
timer already in use) the call runs in a thread of its own and is abandoned at the limit: a Python thread
cannot be killed, so a hung call keeps its thread (a daemon thread, gone when the process exits) while the
caller goes on with the error. A call stuck inside C code that never releases the GIL (a catastrophic regular
expression) can be stopped by neither. rewards/user.py limits each call of a user's grader with it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any


class Overtime(BaseException):
    """Raised inside the call at its time limit: a BaseException, so the callee's own `except Exception` does
    not swallow it."""


def _can_alarm() -> bool:
    """A SIGALRM timer can interrupt the call: on the main thread, where nobody else's timer runs."""
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None)
    )


def _with_alarm(fn: Callable[[], Any], limit_s: float) -> Any:
    fired = []

    def alarm(signum: int, frame: Any) -> None:
        fired.append(signum)
        raise Overtime

    old = signal.signal(signal.SIGALRM, alarm)
    # the timer repeats: a callee whose bare `except:` swallows one Overtime gets another a second later
    signal.setitimer(signal.ITIMER_REAL, limit_s, min(1.0, limit_s))
    try:
        value = fn()
    finally:
        while True:  # the timer may fire once more before it is stopped: stop it whatever happens
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
                break
            except Overtime:
                continue
    if fired:  # it caught the signal and went on: it still took longer than its limit
        raise Overtime
    return value


def _in_thread(fn: Callable[[], Any], limit_s: float, name: str) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # SystemExit too: it must reach the caller, not end this thread quietly
            box["error"] = e

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        raise Overtime  # abandoned: a Python thread cannot be killed (see the module docstring)
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_with_limit(fn: Callable[[], Any], limit_s: float, name: str = "nanogrpo-limited-call") -> Any:
    """fn() stopped at `limit_s` seconds (0: no limit) by raising Overtime; `name`: the thread's, where the
    call runs in one (see the module docstring)."""
    if limit_s <= 0:
        return fn()
    return _with_alarm(fn, limit_s) if _can_alarm() else _in_thread(fn, limit_s, name)
