"""OpenEnv's environments as environments of nanogrpo (the protocol of nanogrpo/envs/__init__.py).

--env.name openenv:package.module:Class runs the class in this process; openenv:http://127.0.0.1:8000 plays on a
server through OpenEnv's GenericEnvClient, a WebSocket session per trajectory, closed at its end. The model's
text is the action's text field (`message`, as OpenEnv's echo and TextArena environments name it, else its one
required string field, from the action class or the server's /schema); reset(seed=seed); an observation (less
done, reward, metadata) reads as its one string field, else as JSON; reward None is 0; reward_range (0, 1) and
max_turns 8 unless an in-process class sets them. An in-process observation whose metadata says `won` (OpenEnv's
convention for games) passes it on as info won (env/win_rate); a server leaves metadata out. Games (TextArena, OpenEnv) do not read the row's prompt: the
first message is the game's own (--data.system-prompt adds instructions).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import re
import urllib.request

from nanogrpo.envs import Environment, Step, accepted, import_class, need, register


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
        meta = getattr(obs, "metadata", None)
        info = {"won": bool(meta["won"])} if isinstance(meta, dict) and "won" in meta else {}
        return Step(observation_text(fields), float(getattr(obs, "reward", None) or 0.0), done, info)

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
