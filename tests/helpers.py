"""Small helpers the test files share: writing JSONL rows, running train.py and eval.py, the tiny preset's
runs and metrics, a fake OpenAI-compatible judge server, GRPO loss batches, the run page's fake run and
headless browser, the sampler tests' prompts, and the linear probe's synthetic rows. (The shared pytest
fixtures are in conftest.py.)"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from nanogrpo.recipes.presets import PRESETS

if TYPE_CHECKING:
    from rewards import Sample
    from rewards.options import JudgeConfig

ROOT = Path(__file__).resolve().parents[1]


def write_rows(path: Path, rows: list[dict]) -> Path:
    """`rows` as a JSONL file at `path` (returned)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_eval(*args, cwd, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python eval.py ARGS` in `cwd`, output captured: in this process (eval.run: the command line's exit
    status and one-line errors, no interpreter to start), or with `fresh` in a new one."""
    if fresh:
        return subprocess.run(
            [sys.executable, str(ROOT / "eval.py"), *map(str, args)], cwd=cwd, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
    import eval as eval_py

    return _in_process(eval_py.run, "eval.py", args, cwd)


def _in_process(run, name: str, args, cwd: Path) -> subprocess.CompletedProcess:
    """run([args]) as `python NAME ARGS` would: in `cwd`, stdout and stderr captured, the exit status (a
    flag tyro refuses exits with its status and message, as the command would)."""
    import io
    import os

    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = run([str(a) for a in args])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess([name, *map(str, args)], code, out.getvalue(), err.getvalue())


def packing_params() -> list:
    """pytest params (dtype, fp32 packer) for each way this CPU packs the sampler's weights: bf16 for oneDNN
    (packer None), float32 for oneDNN ('onednn') and for MKL ('mkl'); each skipped, saying why, where it does
    not run here or NANOGRPO_PACKED=0. `use_packer` makes the packer the one in use."""
    import os

    import pytest
    import torch

    from nanogrpo.infra.cpu import cpu_capability

    cap = cpu_capability()
    off = os.environ.get("NANOGRPO_PACKED") == "0"
    ways = [
        ("bf16", torch.bfloat16, None, cap.onednn_bf16),
        ("fp32-onednn", torch.float32, "onednn", cap.onednn_fp32),
    ]
    ways.append(("fp32-mkl", torch.float32, "mkl", cap.mkl_packed_fp32))
    why = lambda name: "NANOGRPO_PACKED=0" if off else f"no {name} packing on this CPU: {cap}"  # noqa: E731
    return [
        pytest.param(dtype, packer, id=name, marks=pytest.mark.skipif(off or not runs, reason=why(name)))
        for name, dtype, packer, runs in ways
    ]


def use_packer(monkeypatch, packer: str | None) -> None:
    """Pack float32 weights with `packer` ('onednn' or 'mkl') for the rest of the test; None: this CPU's
    default."""
    if packer is None:
        monkeypatch.delenv("NANOGRPO_PACKED_FP32", raising=False)
    else:
        monkeypatch.setenv("NANOGRPO_PACKED_FP32", packer)


def run_train_here(*args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in this process (train.run), for the runs a test only checks the outcome of."""
    import train

    return _in_process(train.run, "train.py", args, cwd)


@contextlib.contextmanager
def train_py_here():
    """While open, `subprocess.run([python, train.py, ARGS...], ...)` runs train.run(ARGS) in this process
    (its exit status; its output printed, or written to the file given as stdout), for the tests of a driver
    that starts train.py once per run (eval.py seeds, the RLVRR table): each run then costs no interpreter
    start (~3 s of imports). Every other command runs as before."""
    real = subprocess.run

    def run(cmd, *args, **kwargs):
        if not (isinstance(cmd, (list, tuple)) and len(cmd) > 1 and Path(str(cmd[1])).name == "train.py"):
            return real(cmd, *args, **kwargs)
        res = run_train_here(*cmd[2:], cwd=Path(kwargs.get("cwd") or Path.cwd()))
        sink = kwargs.get("stdout")
        if hasattr(sink, "write"):
            sink.write(res.stdout + res.stderr)
        else:
            print(res.stdout, end="")
            print(res.stderr, end="", file=sys.stderr)
        return subprocess.CompletedProcess(cmd, res.returncode)

    subprocess.run = run
    try:
        yield
    finally:
        subprocess.run = real


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a server or a torchrun rendezvous a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM to the process group a test started (start_new_session=True), SIGKILL if it lingers."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- train.py on the tiny preset -----------------------------------------------------------------------------

TIMING = ("t_", "tok_per_s")  # the metrics that time a run: they differ between two runs of the same steps
TINY = replace(PRESETS["tiny"][1], plots=False)  # no PNGs or run page: nothing that uses it reads them


def run_train(*args, timeout=600):
    """`python train.py ARGS` in a new interpreter, in the repository root, output captured."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def metrics(run: Path) -> list[dict]:
    """A run folder's metrics.jsonl, one dict a step, without the timings (TIMING)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def tiny(tmp_path, **kw):
    """The tiny preset into tmp_path; without the plots and the run page unless plots=True."""
    return replace(PRESETS["tiny"][1], out_dir=str(tmp_path), **{"plots": False, **kw})


def saved_run(folder, **kw):
    """A run folder as a run started with these settings leaves it (config.json only)."""
    cfg = replace(TINY, out_dir=str(folder), **kw)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    return cfg


# -- a fake judge server on 127.0.0.1 ------------------------------------------------------------------------

KEY = "sk-test-5f3a9c1e7b2d4e6f"
ANSWER = re.compile(r'<answer id="(\d+)">\n(.*?)\n</answer>', re.S)


def quality(text: str) -> int:
    """The fake judge's opinion: 'great' 5, 'good' 4, 'meh' 3, 'bad' 1, else 2."""
    for word, m in (("great", 5), ("good", 4), ("meh", 3), ("bad", 1)):
        if word in text:
            return m
    return 2


def shown_answers(payload: dict) -> list[str]:
    """The answers a judge request shows (in the order shown: shuffled), read from its user message."""
    user = next(m["content"] for m in payload["messages"] if m["role"] == "user")
    return [a for _, a in ANSWER.findall(user)]


def good_marks(payload: dict) -> dict:
    """A well-formed group judgment of the answers `payload` shows: each marked by its quality()."""
    items = [
        {
            "answer": k,
            **{c: quality(a) for c in ("correctness", "helpfulness", "tone", "format")},
            "reason": f"it is {a}",
        }
        for k, a in enumerate(shown_answers(payload), 1)
    ]
    return {"answers": items}


def chat_body(content: str, logprobs: list | None = None) -> dict:
    """A chat-completions reply saying `content`, with `logprobs` (per-token entries) when given."""
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    return {"choices": [choice], "usage": {"prompt_tokens": 100, "completion_tokens": 20}}


class FakeServer:
    """`script(payload, call_index) -> (status, headers, body, delay_s)`; every request is recorded.

    A callable body writes the raw response itself: `body(wfile)` (status line, headers and all).
    GET /v1/models (the start-up check) answers `models_status` with `models_headers` and is counted in
    `gets`."""

    def __init__(self, script, models_status: int = 200, models_headers: dict | None = None):
        self.script, self.requests, self.lock = script, [], threading.Lock()
        self.models_status, self.models_headers, self.gets = models_status, models_headers or {}, []
        self.inflight = self.max_inflight = 0
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output quiet
                pass

            def do_GET(self):
                srv.gets.append({"path": self.path, "headers": dict(self.headers)})
                data = json.dumps(
                    {"object": "list", "data": [{"id": "fake-judge", "object": "model"}]}
                ).encode()
                self.send_response(srv.models_status)
                for k, v in srv.models_headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with srv.lock:
                    n = len(srv.requests)
                    srv.requests.append({"payload": payload, "headers": dict(self.headers), "t": time.time()})
                    srv.inflight += 1
                    srv.max_inflight = max(srv.max_inflight, srv.inflight)
                counted = True  # in flight until its reply starts: the client may send its next request as
                try:  # soon as it has read this one's, before this thread got back to a `finally`
                    status, headers, body, delay = srv.script(payload, n)
                    time.sleep(delay)
                    with srv.lock:
                        srv.inflight, counted = srv.inflight - 1, False
                    if callable(body):
                        body(self.wfile)
                        return
                    data = (body if isinstance(body, str) else json.dumps(body)).encode()
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on a slow reply (the timeout test)
                finally:
                    if counted:
                        with srv.lock:
                            srv.inflight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        """Stop serving and free the port."""
        self.httpd.shutdown()
        self.httpd.server_close()


def cfg_for(srv: FakeServer, **kw) -> JudgeConfig:
    """A JudgeConfig pointed at `srv` (quick timeouts and back-off), `kw` overriding."""
    from rewards.options import JudgeConfig

    base = dict(base_url=srv.url, model="fake-judge", api_key_env="NANOGRPO_TEST_JUDGE_KEY", timeout_s=5.0)
    base.update(backoff_s=0.01, max_retries=2)
    return JudgeConfig(**{**base, **kw})


def batch_of(groups: list[list[str]], reference: str = "the reference") -> list[Sample]:
    """Samples for the judge: each group's completions under one prompt, all with `reference`."""
    from rewards import Sample

    return [
        Sample(prompt=f"user: question {g}", completion=c, group=g, row={"reference": reference})
        for g, comps in enumerate(groups)
        for c in comps
    ]


GROUPS = [["a great answer", "a bad answer", "a good answer", "meh"], ["bad", "great", "good", "other"]]
EXPECTED = [(quality(c) - 1) / 4 for g in GROUPS for c in g]


def tok(text: str, probs: dict[str, float] | None = None) -> dict:
    """A chat-completions logprobs entry for the token `text`, its top_logprobs `probs` (default: certain)."""
    top = [{"token": t, "logprob": math.log(p)} for t, p in (probs or {text: 1.0}).items()]
    return {"token": text, "logprob": top[0]["logprob"], "top_logprobs": top}


def entropy_reply(payload: dict) -> dict:
    """Marks written as {"Answer k": m}, with a distribution over mark tokens at each mark."""
    toks = [tok("{")]
    for k, a in enumerate(shown_answers(payload), 1):
        m = quality(a)
        dist = {f" {m}": 0.7, f" {m - 1}": 0.2, "4": 0.05, " x": 0.05} if m > 1 else {" 1": 1.0}
        toks += [tok(", " if k > 1 else ""), tok('"Answer'), tok(f" {k}"), tok('":'), tok(f" {m}", dist)]
    toks.append(tok("}"))
    return chat_body("".join(t["token"] for t in toks), toks)


def closed_url() -> str:
    """The base URL of a port of 127.0.0.1 that nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


# -- GRPO loss batches ---------------------------------------------------------------------------------------


def batch(N=6, T=5, seed=0):
    """(logp, old, ref, adv, mask) in float64 for the loss tests: N rows of lengths 5, 3, 1, 4, 2, 5 in T
    columns, with garbage (-inf, NaN) in the padding."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([5, 3, 1, 4, 2, 5])[:N]
    mask = (torch.arange(T)[None] < lens[:, None]).double()  # (N, T)
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 2
    logp = old + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    ref = old + 0.5 * torch.randn(N, T, generator=g, dtype=torch.float64)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    # garbage in the padding must not leak into the loss or the gradient
    logp = torch.where(mask > 0, logp, -math.inf)
    old = torch.where(mask > 0, old, math.nan)
    return logp, old, ref, adv, mask


# -- the run page: a fake run folder and a headless browser --------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (.ci/run installs Debian's chromium)"
)
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
]  # fmt: skip


def make_fake_run(root: Path) -> Path:
    """A run folder like train.py writes: 12 steps of metrics (one half-written line at the end, a
    missing value), 3 logged steps of groups with judge marks on some completions, and a config."""
    import numpy as np

    run = root / "fake-run"
    run.mkdir()
    (run / "config.json").write_text(
        json.dumps({"steps": 12, "grpo": {"group_size": 4}, "reward": {"spec": "rouge_l:1"}})
    )
    lines = []
    for s in range(1, 13):
        m = {"step": s, "loss": 0.1 / s, "reward": 0.2 + 0.03 * s, "reward_std": 0.1, "reward/rouge_l": 0.2 + 0.03 * s,
             "reward/exact": 0.1 * (s % 3), "frac_zero_std": 0.25, "kl": 0.001 * s if s != 5 else None,
             "entropy": 2.0 - 0.05 * s, "clip_low": 0.0, "clip_high": 0.01, "ratio_max": 1.1, "len_mean": 30 - s,
             "len_max": 64, "trunc_rate": 0.0, "grad_norm": 0.5, "lr": 1e-4, "tok_per_s": 4000.0, "t_sample": 1.0,
             "t_score": 0.1, "t_train": 0.7, "hack/len_corr/rouge_l": 0.05 * s - 0.2,
             "hack/len_corr/reward": 0.04 * s if s != 3 else None, "hack/best_is_longest/rouge_l": 0.25}  # fmt: skip
        lines.append(json.dumps(m))
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 13, "loss": 0.0')  # a run in progress
    rng = np.random.default_rng(0)
    samples = []
    for step in (1, 6, 11):
        groups = []
        for g in range(2 + step % 2):
            comps = []
            for k in range(4):
                r = float(rng.random())
                c = {"text": f"answer {k} <b>not bold</b> & <script>alert({k})</script>", "reward": r,
                     "scores": {"rouge_l": r, "exact": None if k == 0 else float(r > 0.5)},
                     "advantage": r - 0.5, "length": 5 + k}  # fmt: skip
                if g == 0:
                    c["judge"] = {"correctness": 4, "tone": 3, "reason": "close to the reference"}
                comps.append(c)
            prompt = [{"role": "user", "content": f"q {g}?"}] if g % 2 else f"question {g}?"
            groups.append(
                {
                    "id": f"s{step}g{g}",
                    "prompt": prompt,
                    "reference": None if g == 1 else "ref",
                    "completions": comps,
                }
            )
        samples.append({"step": step, "groups": groups})
    (run / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return run


def chromium(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    """Headless chromium with ARGS (a fresh profile under `tmp`), output captured."""
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args],
                          capture_output=True, text=True, timeout=180)  # fmt: skip


# -- the sampler: prompts, EOS ids, equal samples ------------------------------------------------------------

TEXTS = ["The capital of France is", "What is 12 + 35?", "yes", "<think>I add the numbers.</think> answer"]
LOGP_ATOL = 1e-5  # the static decode loop's log-probs against the eager loop's (float32, 2 layers)
MANY_EOS = tuple(range(3, 1024, 9))  # rows end at different steps


def assert_same(a, b, atol: float = LOGP_ATOL):
    """Two samplers' Generations: equal tokens, masks and truncations; log-probs within `atol`."""
    import torch

    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.mask, b.mask) and torch.equal(a.truncated, b.truncated)
    diff = (a.logp - b.logp).abs().max().item()
    print(f"max |logp a - logp b| = {diff:.2e} (bitwise: {torch.equal(a.logp, b.logp)})")
    assert diff <= atol


# -- linear probes -------------------------------------------------------------------------------------------

WORDS = "alpha beta gamma delta sun moon tree river stone cloud fish bird".split()


def synthetic(n: int, seed: int) -> list[dict]:
    """Balanced rows whose label is the last word (red / blue): linearly readable at the last token."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = i % 2
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        rows.append(
            {"text": " ".join(words) + (" red" if label else " blue"), "label": label, "group": i // 4}
        )
    return rows


# -- real chat templates: TRL's files, on local tokenizers ----------------------------------------------------

TRL_PIN = "1.16.0"  # the trl version make install puts in (--no-deps: only its files are read)


def trl_template(name: str) -> str:
    """The text of one of the real chat templates TRL ships (trl/chat_templates/NAME.jinja: qwen2_5, qwen3,
    llama3_2, ...), read without importing trl (its dependencies are heavy); the test is skipped, saying how
    to install it, when trl is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"trl is not installed (make install does: pip install --no-deps trl=={TRL_PIN})")
    return (Path(spec.submodule_search_locations[0]) / "chat_templates" / f"{name}.jinja").read_text()


# the tokens each family's template writes, as its tokenizer holds them: Llama 3's control tokens are special
# (decoding drops them), Qwen's <tool_call> and <think> are plain added tokens (decoding keeps their text)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                   "<|python_tag|>"]  # fmt: skip
QWEN_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def template_tokenizer(name: str, tokens: bool = True):
    """The tiny model's tokenizer (ChatML's <|im_start|> and <|im_end|> among its 1,024 ids) with TRL's real
    chat template NAME, and with `tokens` the tokens that template writes added as its family's tokenizer
    has them (ids past the tiny model's vocabulary: for tests that run no model). Llama 3 templates get
    <|eot_id|> as EOS and <|begin_of_text|> as BOS. Nothing is downloaded."""
    from transformers import AutoTokenizer

    from nanogrpo.model.zoo import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    tok.chat_template = trl_template(name)
    if tokens and name.startswith("llama3"):
        tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
        tok.add_tokens(LLAMA3_SPECIALS, special_tokens=True)
    elif tokens and name.startswith("gemma"):
        tok.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    elif tokens:
        tok.add_tokens(QWEN_TOKENS)
    return tok


class Scripted:
    """A sampler that writes the same scripted turns in every row (each turn's tokens fed through the model, as
    the real decode leaves its cache), so an episode's layout can be checked token by token."""

    turns: list[list[int]] = []

    @staticmethod
    def make(base):
        class S(base):
            k = 0

            def decode(self, logits, max_new, generator, *, pad_id=0, **kw):
                import torch

                from nanogrpo.model.sampling import finish

                turn = Scripted.turns[S.k]
                S.k += 1
                N, T = logits.shape[0], len(turn)
                if T > 1:
                    self._forward(self.cache, [turn[:-1]] * N)
                self.pending = [turn[-1]] * N
                tokens = torch.tensor([turn] * N)  # (N, T)
                ended = torch.ones(N, dtype=torch.bool)  # (N,)
                return finish(tokens, torch.zeros(N, T), torch.full((N,), T), ended, pad_id)

        return S


def completions(gen) -> list[list[int]]:
    """Each row's completion ids without padding."""
    return [row[:n] for row, n in zip(gen.completion_ids.tolist(), gen.lengths.tolist())]


def per_prompt(n: int, base: int = 100):
    """n seeded generators, one a row."""
    import torch

    return [torch.Generator().manual_seed(base + i) for i in range(n)]


def check_continuation(model, prompts: list[list[int]], decode: str) -> None:
    """Three turns of rows that each get their own observation between turns: continued (the sampler feeds
    only each row's last token and its observation) and re-prefilled (a fresh sampler given each row's whole
    history) draw the same tokens from the same generators, log-probs equal to float32 rounding, in each
    decode mode an episode runs with ('plain': --plain's sampler, sampling.Episodes, on the weights as they
    are)."""
    import torch

    from nanogrpo.model.fast.row_sampler import Sampler
    from nanogrpo.model.fast.sampler import sampling_weights
    from nanogrpo.model.sampling import Episodes, eval_mode

    if decode == "plain":
        with eval_mode(model):
            return check_turns(lambda: Episodes(model, 7), prompts, decode, lambda s: s.attn.sum(1))
    with torch.inference_mode(), sampling_weights(model, 2 * len(prompts)) as (head, packed, amp):
        check_turns(lambda: Sampler(model, head, 7, packed, amp), prompts, decode, lambda s: s.cache.lengths)


def check_turns(new_sampler, prompts: list[list[int]], decode: str, held) -> None:
    """check_continuation with samplers from `new_sampler`; `held`: the tokens each row's cache holds."""
    import torch

    rows = [i // 2 for i in range(2 * len(prompts))]  # two rows a prompt
    obs = torch.Generator().manual_seed(7)

    def turn(sampler, logits, t):
        gens = per_prompt(len(rows), 1000 * t)  # one per row, as an episode's
        return sampler.decode(logits, 7, gens, eos_ids=MANY_EOS, decode_mode=decode)

    with torch.inference_mode():
        sampler = new_sampler()
        history = [list(prompts[i]) for i in rows]  # what each row has read and written
        logits = sampler.prefill(prompts, rows)
        for t in range(3):
            gen = turn(sampler, logits, t)
            fresh = new_sampler()
            again = turn(fresh, fresh.prefill(history, range(len(rows))), t)
            assert torch.equal(gen.completion_ids, again.completion_ids) and torch.equal(gen.mask, again.mask)
            torch.testing.assert_close(gen.logp, again.logp, atol=1e-5, rtol=0)
            chunks = [torch.randint(5, 500, (int(n),), generator=obs).tolist() for n in torch.randint(1, 9, (len(rows),), generator=obs)]  # fmt: skip
            history = [
                h + c[:n] + o for h, c, n, o in zip(history, completions(gen), gen.lengths.tolist(), chunks)
            ]
            logits = sampler.extend(chunks)
            assert held(sampler).tolist() == [len(h) for h in history]


# -- hostile environments in whole runs (tests/hostile_envs.py) ------------------------------------------------

HOSTILE = str(Path(__file__).with_name("hostile_envs.py"))
G = 2  # each row's episodes


def rows_file(path: Path, faults) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"play {f or 'fair'}", "fault": f}) + "\n" for f in faults))
    return path


def run_args(env: str, data: Path, out: Path, *more) -> list:
    return ["tiny", "--env.spec", f"{HOSTILE}:{env}", "--reward.allow-user-code", "--reward.spec", "env:1",
            "--data.train", data, "--grpo.group-size", str(G), "--sampling.max-new-tokens", "8",
            "--env.max-tokens", "160", "--eval-prompts", "0", "--no-plots", "--out-dir", out, *more]  # fmt: skip


def leftovers(marker: str) -> list[str]:
    """The command lines of running processes that hold `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and d.name != str(os.getpid()):
            found.append(cmd)
    return found


def check_resume_and_peft_generate(model_dir: Path, tmp_path: Path, flags: list) -> tuple[list[dict], str]:
    """Two GRPO steps straight, and one step then --resume for the second: the same metrics. The adapter's greedy
    completions from eval.py generate are transformers' greedy text with PEFT's adapter (the model of a random
    checkpoint whose EOS is 2 and pad 0). `flags`: train.py's, the model's folder among them. Returns the
    straight run's metrics and console output."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nanogrpo.model.zoo import load_tokenizer

    def steps(out: Path) -> list[dict]:
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    r = run_train_here(*flags, "--steps", "2", "--out-dir", tmp_path / "straight")
    assert r.returncode == 0, r.stderr[-3000:]
    said = r.stdout
    r = run_train_here(*flags, "--steps", "1", "--save-every", "1", "--out-dir", tmp_path / "resumed")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train_here("tiny", "--out-dir", tmp_path / "resumed", "--resume", "--steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    keys = ("reward", "loss", "grad_norm", "len_mean", "sampler_kl")
    a, b = steps(tmp_path / "straight"), steps(tmp_path / "resumed")
    assert [[m[k] for k in keys] for m in a] == [[m[k] for k in keys] for m in b]

    adapter = tmp_path / "straight" / "adapter"
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "reference": "x"}) + "\n" for p in ("a b c", "d e")))
    r = run_eval("generate", "--data", rows, "--model", model_dir, "--adapter", adapter, "--dtype", "float32",
                 "--max-new-tokens", "6", "--temperature", "0", "--out", tmp_path / "ours.jsonl", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ours = [json.loads(line)["completion"] for line in (tmp_path / "ours.jsonl").read_text().splitlines()]
    tok = load_tokenizer(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    theirs = PeftModel.from_pretrained(base, adapter).eval()
    for text, got in zip(("a b c", "d e"), ours):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = torch.tensor(
            [tok(prompt, add_special_tokens=False)["input_ids"]]
        )  # as nanogrpo renders a prompt
        out = theirs.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=0)
        assert got == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return a, said
