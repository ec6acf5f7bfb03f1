"""TextArena and OpenEnv games as environments (the protocol of nanogrpo/envs/__init__.py). envs/adapters.py
imports this module, so the registry finds `textarena:` and `openenv:`, and uses its helpers (need, import_class,
accepted); its docstring has the TRL-style tool classes.

TextArena single-player games (--env.name textarena:GuessTheNumber-v0): textarena.make(id), reset(num_players=1,
seed=seed), each turn's text to step(text) as is. The game's observation is cumulative: the model reads what
is new since the last one (the first message: all of it; a text that does not start with what was seen: all
of it again), the game's echo of the move included. The reward is close()'s for player 0 at the game's end,
reward_range (-1, 1); a move the game calls invalid is info invalid; max_turns is the game's (else 10). Each
game runs on its own saved state of Python's global random, which TextArena seeds and draws from.

OpenEnv (--env.name openenv:package.module:Class in this process, openenv:http://127.0.0.1:8000 a server via
OpenEnv's GenericEnvClient, a WebSocket session per trajectory, closed at its end): the model's text is the
action's text field (`message`, as OpenEnv's echo and TextArena environments name it, else its one required
string field, from the action class or the server's /schema); reset(seed=seed); an observation (less done,
reward, metadata) reads as its one string field, else as JSON; reward None is 0; reward_range (0, 1) and
max_turns 8 unless an in-process class sets them. Games (TextArena, OpenEnv) do not read the row's prompt:
the first message is the game's own (--data.system-prompt adds instructions).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import importlib.util
import inspect
import json
import random
import re
import urllib.request

from nanogrpo.envs import Environment, Step, register


def need(module: str, package: str, label: str) -> None:
    """A ValueError naming the pip package when `module` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"{label} needs the {package} package: pip install {package} (or pip install -e '.[envs]')"
        )


def import_class(target: str, label: str) -> type:
    """The class of 'package.module:ClassName', with a ValueError that says how to fix a bad name."""
    module, sep, name = target.rpartition(":")
    if not sep or not module or not name.isidentifier():
        raise ValueError(f"--env.name {label}: write {label.split(':')[0]}:package.module:ClassName")
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError as e:
        raise ValueError(f"--env.name {label}: importing {module} failed: {e}") from e
    if not isinstance(cls, type):
        raise ValueError(f"--env.name {label}: module {module} has no class {name!r}")
    return cls


def accepted(fn, kwargs: dict) -> dict:
    """The keyword arguments fn's signature takes (all of them when it has **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in {p.name for p in params}}


# -- TextArena ---------------------------------------------------------------------------------------------

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
            return Step(new, 0.0, False, {"invalid": INVALID_MOVE in new})
        out = self._isolated(self.game.close)
        rewards, info = out if isinstance(out, tuple) else (out, {})
        info = (info or {}).get(0, {})
        info = {"reason": str(info.get("reason", "")), "invalid": bool(info.get("invalid_move"))}
        return Step(None, float((rewards or {}).get(0, 0.0)), True, info)


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


# -- OpenEnv -----------------------------------------------------------------------------------------------


def text_field(schema: dict, label: str) -> str:
    """The action field that takes the model's text: `message`, else the one required string field, else
    the one string field (metadata aside)."""
    props = schema.get("properties", {})
    strings = [k for k, p in props.items() if k != "metadata" and "string" in
               [p.get("type"), *(x.get("type") for x in p.get("anyOf", ()))]]  # fmt: skip
    required = [k for k in strings if k in schema.get("required", ())]
    for choice in (["message"] if "message" in strings else [], required, strings):
        if len(choice) == 1:
            return choice[0]
    raise ValueError(
        f"{label}: cannot tell which action field takes the model's text (string fields: {strings or 'none'}); "
        "nanogrpo sends it as `message`, or as the action's one string field"
    )


def observation_text(fields: dict) -> str:
    """An OpenEnv observation's text: its one string field, else its fields as JSON (less done, reward and
    metadata, which OpenEnv's server leaves out too)."""
    fields = {k: v for k, v in (fields or {}).items() if k not in ("done", "reward", "metadata")}
    texts = [v for v in fields.values() if isinstance(v, str)]
    return texts[0] if len(texts) == 1 else json.dumps(fields, sort_keys=True, default=str)


class OpenEnvLocal(Environment):
    """One trajectory of an OpenEnv Environment subclass in this process."""

    stop, role = (), "user"

    def __init__(self, cls: type, action_cls: type, field: str):
        self.env, self.action_cls, self.field = cls(), action_cls, field
        self.max_turns = int(getattr(cls, "max_turns", 8))
        self.reward_range = tuple(getattr(cls, "reward_range", (0.0, 1.0)))

    def _step(self, obs) -> Step:
        fields = obs.model_dump() if hasattr(obs, "model_dump") else vars(obs)
        done = bool(getattr(obs, "done", False))
        if done and callable(getattr(self.env, "close", None)):
            self.env.close()
        return Step(observation_text(fields), float(getattr(obs, "reward", None) or 0.0), done)

    def reset(self, row: dict, seed: int) -> str:
        return self._step(self.env.reset(**accepted(self.env.reset, {"seed": seed}))).observation

    def step(self, text: str) -> Step:
        return self._step(self.env.step(self.action_cls(**{self.field: text})))


class OpenEnvClient(Environment):
    """One trajectory on an OpenEnv server: a WebSocket session, opened at reset and closed when it ends."""

    stop, role, max_turns, reward_range = (), "user", 8, (0.0, 1.0)

    def __init__(self, client_cls: type, url: str, field: str):
        self.client_cls, self.url, self.field, self.client = client_cls, url, field, None

    def _step(self, result) -> Step:
        if result.done:
            self.close()
        return Step(observation_text(result.observation), float(result.reward or 0.0), bool(result.done))

    def reset(self, row: dict, seed: int) -> str:
        self.close()
        self.client = self.client_cls(base_url=self.url).sync()
        self.client.connect()
        return self._step(self.client.reset(seed=seed)).observation

    def step(self, text: str) -> Step:
        return self._step(self.client.step({self.field: text}))

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):  # the server went away: nothing left to close
                client.close()

    def __del__(self):
        self.close()


def server_schema(url: str, label: str) -> dict:
    """The server's /schema (the action's JSON schema under "action"), or a ValueError when none answers."""
    http = re.sub(r"^ws", "http", url.rstrip("/"))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local server: no proxy
    try:
        with opener.open(f"{http}/schema", timeout=5) as r:
            return json.loads(r.read())
    except Exception as e:
        raise ValueError(
            f"{label}: no OpenEnv server answers at {url} ({type(e).__name__}: {e}); start it first "
            "(e.g. uvicorn your_env.server.app:app --host 127.0.0.1 --port 8000)"
        ) from e


def action_class(cls: type, label: str) -> type:
    """The action class an OpenEnv Environment's step takes, from its type hints."""
    import typing

    params = [p for p in inspect.signature(cls.step).parameters if p != "self"]
    try:
        hint = typing.get_type_hints(cls.step).get(params[0]) if params else None
    except Exception as e:  # a hint that names what the module does not import
        raise ValueError(f"{label}: cannot read the type hints of {cls.__name__}.step: {e}") from e
    if not hasattr(hint, "model_json_schema"):
        raise ValueError(
            f"{label}: {cls.__name__}.step must annotate its action with an OpenEnv Action class"
        )
    return hint


@register("openenv")
def _openenv(target: str):
    label = f"--env.name openenv:{target}"
    need("openenv", "openenv-core", label)
    if re.match(r"(https?|wss?)://", target):
        from openenv.core.generic_client import GenericEnvClient  # imported now: seconds (it imports gradio)

        field = text_field(server_schema(target, label).get("action", {}), label)
        return functools.partial(OpenEnvClient, GenericEnvClient, target, field)
    cls = import_class(target, f"openenv:{target}")
    if not (callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise ValueError(f"{label}: {cls.__name__} is not an OpenEnv Environment (it needs reset and step)")
    act = action_class(cls, label)
    return functools.partial(OpenEnvLocal, cls, act, text_field(act.model_json_schema(), label))
