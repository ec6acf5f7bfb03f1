"""What running environments in worker processes costs (nanogrpo/envs/workers.py), side by side with calling
them in the trainer's process as before: a step's round trip, a rollout's environment time, a worker's fork
and its keeper's (before and after a model is loaded) and their memory.

    python bench/env_calls.py                      # the guess game, 24 episodes (the guess preset's step)
    python bench/env_calls.py --episodes 64 --model smollm2

The episodes play the built-in `guess` with fixed texts (no model samples), so what is timed is only the
environment calls: in the trainer's process (a direct call, the cost before workers) and through the workers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from nanogrpo.envs.builtin import Guess
from nanogrpo.envs.keeper import descendants
from nanogrpo.envs.workers import Workers


def private_kb(pid: int) -> int:
    """A process's memory of its own (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup), in kB."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean", "Private_Dirty")):
                total += int(line.split()[1])
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--model", default="smollm2", help="loaded before the second fork timing ('' = none)")
    a = ap.parse_args()
    n, row = a.episodes, {"lo": 1, "hi": 20}
    texts = [str(3 + 4 * t) for t in range(a.turns)]  # never the target of every seed: episodes go on

    def direct() -> None:
        envs = [Guess() for _ in range(n)]
        for k, env in enumerate(envs):
            env.reset(dict(row), 1000 + k)
        for text in texts:
            for env in envs:
                env.step(text)

    t0 = time.perf_counter()
    workers = Workers(Guess, limit_s=10.0)
    workers.grow(n)
    fork_small = (time.perf_counter() - t0) / n

    def guarded() -> None:
        workers.call({k: ("make", None) for k in range(n)})
        workers.call({k: ("reset", (dict(row), 1000 + k, 4096)) for k in range(n)})
        for text in texts:
            workers.call({k: ("step", (text, 4096)) for k in range(n)})
        workers.call({k: ("end", None) for k in range(n)})

    times = {"direct": [], "workers": []}
    for _ in range(a.repeat):  # alternated, so that a busy moment costs both sides
        for name, fn in (("direct", direct), ("workers", guarded)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    d, w = (statistics.median(times[k]) for k in ("direct", "workers"))
    calls = n * (a.turns + 3)  # make, reset, the steps, end
    one_trip = []
    for _ in range(200):
        t0 = time.perf_counter()
        workers.call({0: ("end", None)})
        one_trip.append(time.perf_counter() - t0)
    one_trip.sort()
    mem = statistics.median(
        private_kb(p.pid) + sum(map(private_kb, descendants(p.pid))) for p in workers.procs if p
    )
    fork_big = None
    if a.model:
        from nanogrpo.model.transformer import Transformer
        from nanogrpo.model.zoo import resolve_model

        model = Transformer.from_pretrained(resolve_model(a.model))  # noqa: F841 (held: the trainer's memory)
        t0 = time.perf_counter()
        big = Workers(Guess, limit_s=10.0)
        big.grow(8)
        fork_big = (time.perf_counter() - t0) / 8
        big.close()
    workers.close()

    print(f"{n} episodes of guess x {a.turns} turns, {calls} calls a rollout, {os.cpu_count()} cores")
    print("| what | value |\n|---|---|")
    print(
        f"| a rollout's environment calls, in the trainer's process (median of {a.repeat}) | {d * 1e3:.1f} ms |"
    )
    print(f"| the same through the workers | {w * 1e3:.1f} ms |")
    print(f"| added per call | {(w - d) / calls * 1e6:.0f} us |")
    print(f"| one call's round trip: median / 99th percentile of 200 | {one_trip[100] * 1e6:.0f} / "
          f"{one_trip[198] * 1e6:.0f} us |")  # fmt: skip
    print(
        f"| forking a worker and its keeper before the model loads (start-up) | {fork_small * 1e3:.1f} ms |"
    )
    if fork_big is not None:
        print(f"| forking one with {a.model} loaded (a worker replaced mid-run) | {fork_big * 1e3:.1f} ms |")
    print(f"| an idle worker's and its keeper's own memory (private pages), median | {mem / 1024:.1f} MiB |")
    print(f"\npython bench/env_calls.py --episodes {n} --turns {a.turns} --model {a.model}")


if __name__ == "__main__":
    main()
