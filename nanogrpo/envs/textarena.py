"""TextArena's single-player games as environments (the protocol of nanogrpo/envs/__init__.py).

--env.name textarena:GuessTheNumber-v0: textarena.make(id), reset(num_players=1, seed=seed), each turn's text
to step(text) as is. The game's observation is cumulative: the model reads what
is new since the last one (the first message: all of it; a text that does not start with what was seen: all
of it again), the game's echo of the move included. The reward is close()'s for player 0 at the game's end,
reward_range (-1, 1); info won is True for a game that ended at reward 1, the game's win (the win rate,
env/win_rate: a game ended at the turn limit with partial credit, lost, or cut by a budget is no win); a move
the game calls invalid is info invalid; max_turns is the game's (else 10). Each
game runs on its own saved state of Python's global random, which TextArena seeds and draws from.
"""

from __future__ import annotations

import difflib
import functools
import random
import re

from nanogrpo.envs import Environment, Step, need, register

INVALID_MOVE = "You attempted an invalid move"


def observation_delta(seen: str, full: str) -> str:
    """What is new in a cumulative observation: the text after `seen` when it starts with it, else all of it;
    blank lines around it dropped."""
    new = full[len(seen) :] if seen and full.startswith(seen) else full
    return new.strip("\n")


class TextArenaGame(Environment):
    """One game of a TextArena single-player environment."""

    stop, role, reward_range = (), "user", (-1.0, 1.0)

    def __init__(self, game_id: str):
        import textarena

        self._rng = random.Random(0).getstate()  # this game's own state of Python's global random
        self.game = self._isolated(textarena.make, game_id)
        turns = getattr(self.game, "max_turns", None)  # wrappers pass attributes through
        self.max_turns = turns if isinstance(turns, int) and turns > 0 else 10
        self.seen = ""

    def _isolated(self, fn, *args, **kwargs):
        """fn(...) on this game's random state: TextArena seeds and draws from the global one."""
        outer = random.getstate()
        random.setstate(self._rng)
        try:
            return fn(*args, **kwargs)
        finally:
            self._rng = random.getstate()
            random.setstate(outer)

    def _observe(self) -> str:
        full = self._isolated(self.game.get_observation)[1]  # (player id, observation)
        if not isinstance(full, str):  # a '-raw' game's: its (sender, text, kind) messages
            full = "".join(f"\n{m[1]}" for m in full)
        new, self.seen = observation_delta(self.seen, full), full
        return new

    def reset(self, row: dict, seed: int) -> str:
        self._isolated(self.game.reset, num_players=1, seed=seed)
        self.seen = ""
        return self._observe()

    def step(self, text: str) -> Step:
        done, _ = self._isolated(self.game.step, text)
        if not done:
            new = self._observe()
            return Step(new, 0.0, False, {"invalid": INVALID_MOVE in new, "won": False})
        out = self._isolated(self.game.close)
        rewards, info = out if isinstance(out, tuple) else (out, {})
        info = (info or {}).get(0, {})
        reward = float((rewards or {}).get(0, 0.0))
        info = {
            "reason": str(info.get("reason", "")),
            "invalid": bool(info.get("invalid_move")),
            "won": reward >= 1.0,
        }
        return Step(None, reward, True, info)


def _nltk_hint(e: LookupError) -> str:
    m = re.search(r"Resource\s+(?:\x1b\[\d+m)?'?([\w.]+)", str(e))
    name = m.group(1) if m else "words"
    return (
        f"it needs the NLTK data {name!r}, which is not installed and could not be downloaded: run "
        f"`python -m nltk.downloader {name}` once where there is internet (or set NLTK_DATA to a folder "
        "that holds it), or pick a game that needs no word list"
    )


@register("textarena")
def _textarena(game_id: str):
    label = f"--env.name textarena:{game_id}"
    if not game_id:
        raise ValueError("--env.name textarena: name the game, e.g. textarena:GuessTheNumber-v0")
    need("textarena", "textarena", label)
    from textarena.envs.registration import ENV_REGISTRY

    if game_id not in ENV_REGISTRY:
        near = difflib.get_close_matches(game_id, list(ENV_REGISTRY), n=3)
        raise ValueError(
            f"{label}: TextArena has no game {game_id!r}"
            + (f"; did you mean {', '.join(near)}?" if near else "")
        )
    try:  # one game made and reset now, so a missing word list or a two-player game fails before the model loads
        TextArenaGame(game_id).reset({}, 0)
    except LookupError as e:
        raise ValueError(f"{label}: {_nltk_hint(e)}") from e
    except AssertionError as e:
        raise ValueError(f"{label}: not a single-player game ({e})") from e
    except Exception as e:
        raise ValueError(f"{label}: the game failed to start: {type(e).__name__}: {e}") from e
    return functools.partial(TextArenaGame, game_id)
