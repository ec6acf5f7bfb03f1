"""Step metrics: which are shown and where (METRICS: the console line, the PNGs, the run page), the console
line, metrics.jsonl / samples.jsonl, optional W&B/TB, and the run folder's file primitives that every writer
of the folder uses. The PNGs are drawn in infra/plots.py.

Only rank 0 writes. Every write is a whole line flushed at once, so a crash loses at most the step in
flight; on resume the files are truncated back to the checkpoint's step so no step appears twice. That
rewrite is atomic (a new file, fsynced, renamed over the old one), and a torn last line (a write a crash or
a full disk cut short) is dropped; a line that is not JSON with lines after it is an error, unless every
line after it comes after the checkpoint too (they are all run again).

A run folder's files are opened for writing with `open_run_file` / `open_run_fd` only: never through a
symbolic link (O_NOFOLLOW), so a `metrics.jsonl` that someone made a link to `~/.bashrc` is refused by name
instead of appended to. `replace_atomically` renames over a link (which replaces the link, not its target)
and creates its temp file exclusively. `sha256_file` hashes in 1 MiB blocks: data files can be gigabytes.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from nanogrpo_base.rows import json_line, json_safe

# What nanogrpo shows of a step: the one table the console line, the PNGs (infra/plots.py) and the run page
# (eval/report.py) read. Rows: (key, panel, console label, console format), in the console line's order; a
# key ending in "*" stands for every key that starts so. A panel is one PNG, <panel>.png, and one chart of the
# run page, in the order of its first row; a logged number of no row goes to the panel "other". A row without
# a label stays off the console line.
METRICS = [
    ("reward", "reward", "", ""),  # the console line writes the reward and its graders itself
    ("reward/*", "reward", "", ""),  # each grader's mean score
    ("reward_std", "reward", "", ""),  # drawn as a +-1 std band around the reward
    ("env/win_rate", "reward", "win", "{:.2f}"),  # --env: a game's episodes that it says were won
    ("loss", "loss", "loss", "{:.4f}"),
    ("ppl", "ppl", "ppl", "{:.1f}"),  # CPT: the perplexity of the text
    ("reward_acc", "dpo_rewards", "acc", "{:.2f}"),  # DPO: the fraction of pairs whose chosen answer wins
    ("reward_margin", "dpo_rewards", "margin", "{:.3f}"),  # DPO: beta * (chosen - rejected log-ratio)
    ("reward_chosen", "dpo_rewards", "", ""),
    ("reward_rejected", "dpo_rewards", "", ""),
    ("logp_chosen", "dpo_logp", "", ""),
    ("logp_rejected", "dpo_logp", "", ""),
    ("len_mean", "length", "len", "{:.0f}"),
    ("len_max", "length", "", ""),
    ("kl", "kl_entropy", "kl", "{:.4f}"),
    (
        "sampler_kl",
        "sampler_gap",
        "gap",
        "{:.0e}",
    ),  # KL(sampler || trainer)/token: float32 rounding ~1e-13 (summary.GAP_BOUND)
    ("sampler_abs_diff", "sampler_gap", "", ""),
    ("entropy", "kl_entropy", "ent", "{:.2f}"),
    ("frac_zero_std", "zero_std", "zero-std", "{:.2f}"),  # groups whose completions all scored the same
    ("trunc_rate", "zero_std", "", ""),  # completions cut at the token limit
    ("env/tool_calls", "tools", "calls", "{:.2f}"),  # a tool environment: calls per episode
    ("env/no_tool_call", "tools", "", ""),  # the share of its episodes without a call
    ("env/tool_parse_errors", "tools", "", ""),  # calls per episode that could not be parsed
    ("grad_norm", "grad_norm", "gnorm", "{:.3f}"),
    ("vf_loss", "value", "vf", "{:.3f}"),  # PPO's value loss
    ("explained_variance", "value", "ev", "{:.2f}"),  # PPO's critic: 1 fits the returns, <= 0 does not
    ("clip_low", "clip", "", ""),
    ("clip_high", "clip", "", ""),
    ("offpolicy/clip_*", "clip", "", ""),  # the passes after the first
    ("hack/len_corr/*", "len_corr", "", ""),  # within-group correlation of each grader's score and length
    ("hack/best_is_longest/*", "best_is_longest", "", ""),  # groups whose best completion is the longest
    ("t_sample", "time", "", ""),
    ("t_score", "time", "", ""),
    ("t_train", "time", "", ""),
    ("eval/*", "eval", "", ""),  # --eval-every: held-out greedy means, pass@k, avg@k at step 0 and every K
]
TITLES = {
    "kl_entropy": "KL and entropy",
    "sampler_gap": "sampler-trainer gap",
    "zero_std": "zero-std groups / truncation",
    "clip": "clipped fraction",
    "len_corr": "score-length correlation in groups",
    "best_is_longest": "best is longest (fraction of groups)",
    "time": "time per step (s)",
    "eval": "held-out eval",
    "tools": "tool calls per episode / share without a call",
    "other": "every other number",
}  # a panel's title on its PNG and on the run page where it is not the panel's name


def panels(keys: Iterable[str]) -> dict[str, list[str]]:
    """The logged keys by panel (METRICS), in the table's order, a prefix's keys sorted; the keys of no row
    last, in the panel 'other'. Panels without a key are left out."""
    keys = list(dict.fromkeys(keys))
    out: dict[str, list[str]] = {}
    for key, panel, _, _ in METRICS:
        prefix = key[:-1] if key.endswith("*") else None
        hits = sorted(k for k in keys if k.startswith(prefix)) if prefix else [key] * (key in keys)
        out.setdefault(panel, []).extend(hits)
    shown = {k for ks in out.values() for k in ks}
    out["other"] = [k for k in keys if k not in shown]
    return {p: ks for p, ks in out.items() if ks}


def _fmt_rate(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def console_line(m: dict[str, Any]) -> str:
    """`step 12 | reward 0.43 (fmt 0.90, acc 0.31) | len 187 | kl 0.002 | 5.1k tok/s`"""
    parts = [f"step {m['step']}"]
    if "reward" in m:
        comps = [
            f"{k.split('/', 1)[1]} {v:.2f}" for k, v in m.items() if k.startswith("reward/") and v is not None
        ]
        r = "reward none" if m["reward"] is None else f"reward {m['reward']:.3f}"  # no grader scored
        parts.append(r + (f" ({', '.join(comps)})" if len(comps) > 1 else ""))
    for key, _, label, fmt in METRICS:
        v = m.get(key) if label else None
        if v is not None:  # kl is None when no KL is computed
            parts.append(f"{label} {fmt.format(v)}")
    if m.get("env/failed"):  # --env: episodes their environment failed (no reward)
        parts.append(f"failed {m['env/failed']:.0f}")
    if "loss" in m and m["loss"] is None:  # no completion had a reward: the step trained nothing
        parts.append("no update")
    if m.get("resample_rounds"):  # --grpo.dynamic-sampling drew more: informative groups of those drawn
        parts.append(f"kept {m['groups_kept']}/{m['groups_drawn']}")
    if m.get("tok_per_s"):
        parts.append(f"{_fmt_rate(m['tok_per_s'])} tok/s")
    if "t_step" in m:
        parts.append(f"{m['t_step']:.1f}s")
    return " | ".join(parts)


def _parse_lines(path: Path) -> tuple[list[str], list[dict], bool]:
    """The lines of a JSONL log and their objects. A last line that is not valid JSON is the write a crash
    cut short: dropped (the third value says so). One in the middle is damage that would lose steps
    silently: ValueError naming the file and the line."""
    lines = [ln for ln in path.read_text(encoding="utf-8").split("\n") if ln.strip()]
    objs = []
    for i, ln in enumerate(lines):
        try:
            objs.append(json.loads(ln))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                return lines[:-1], objs, True
            raise ValueError(
                f"{path}, line {i + 1}: not valid JSON ({e.msg}), and lines follow it; the log is damaged: "
                "repair or delete that line, then resume"
            ) from e
    return lines, objs, False


def link_refused(path: Path) -> ValueError:
    """The error for a run-folder file that is a symbolic link: which one, where it points, and the fix."""
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return ValueError(
        f"{path} is a symbolic link{target}: nanogrpo writes a run folder's own files, never through a link, "
        f"which could point anywhere; remove the link (rm {path}) and run again"
    )


def open_run_fd(path: Path, flags: int, mode: int = 0o666) -> int:
    """os.open of a run-folder file that never follows a link in its last component: ValueError (saying
    which file and how to fix it) for a link, dangling or not, and for anything but a regular file (a FIFO
    would block the run). Every write into a run folder opens its file through here; a new file's mode is
    the umask's, as open() gives (0o644 under umask 022, 0o664 under a group's 002)."""
    try:
        # O_NONBLOCK: a FIFO fails at once instead of waiting for a reader; a regular file ignores it
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        # ELOOP: O_NOFOLLOW met a link; EEXIST with O_EXCL: a link (even a dangling one) holds the name
        if e.errno in (errno.ELOOP, errno.EEXIST) and os.path.islink(path):
            raise link_refused(path) from None
        if e.errno == errno.ENXIO:
            raise ValueError(f"{path} is not a regular file (a FIFO?): remove it and run again") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file: remove it and run again")
    return fd


_OPEN_FLAGS = {
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,  # a new file: FileExistsError if the name is taken
}


def open_run_file(path: Path, mode: str = "a") -> IO:
    """A run-folder file opened for writing ('a', 'w' or 'x'; add 'b' for bytes) through open_run_fd."""
    fd = open_run_fd(path, _OPEN_FLAGS[mode[0]])
    binary = "b" in mode
    # the file exists now, created by this call if need be: fdopen's 'w' only names the direction
    return os.fdopen(
        fd, ("a" if mode[0] == "a" else "w") + ("b" if binary else ""), encoding=None if binary else "utf-8"
    )


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    """The sha256 of a file's content, read in 1 MiB blocks (a data file or a checkpoint can be GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file (or a folder's entries) to the disk: a rename is durable only after both are."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: Path, text: str) -> None:
    """path's content becomes text, or (on a crash or a full disk) stays what it was: a new file, fsynced,
    renamed over the old one. Also the run page's and the checkpoint pointer's write.

    A link at `path` is replaced, not followed (rename replaces the name). The temp file is created
    exclusively: one a crash left, or a link someone put in its place, is removed first, never written
    through."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # removes a link itself, never its target
    try:
        with open_run_file(tmp, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)  # the rename itself is durable once the folder is synced


class JsonlWriter:
    """Append-only JSONL with truncation back to a step on resume."""

    def __init__(self, path: Path):
        self.path = path

    def truncate_after(self, step: int) -> int:
        """Drop lines whose step is > `step` (they came after the checkpoint we resume from), and torn ones
        (not JSON) that only such lines follow: whatever step a torn line was, it is `step` or later, so it
        is run again (and `step`'s own line comes back from the checkpoint: restore_line). A torn line with
        a line of step <= `step` after it is damage: ValueError naming the file and the line. Returns how
        many lines were dropped; the rewrite is atomic."""
        if self.path.is_symlink():
            raise link_refused(self.path)
        if not self.path.exists():
            return 0
        text = self.path.read_text(encoding="utf-8")
        lines = [ln for ln in text.split("\n") if ln.strip()]
        keep: list[str] = []
        torn = None  # (line number, why) of the first line that is not a JSON object
        for i, ln in enumerate(lines):
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                torn = torn or (i + 1, e.msg)
                continue
            if not isinstance(obj, dict):
                torn = torn or (i + 1, "not a JSON object")
            elif obj.get("step", 0) <= step:
                if torn is not None:
                    raise ValueError(
                        f"{self.path}, line {torn[0]}: not valid JSON ({torn[1]}), and lines follow it; the log "
                        "is damaged: repair or delete that line, then resume"
                    )
                keep.append(ln)
        dropped = len(lines) - len(keep)
        if dropped or not text.endswith("\n"):  # the next line must start a line
            replace_atomically(self.path, "".join(ln + "\n" for ln in keep))
        return dropped

    def has_step(self, step: int) -> bool:
        """Whether the log holds a whole line of `step`."""
        return any(o.get("step") == step for o in read_jsonl(self.path))

    def write(self, obj: dict) -> None:
        self.append_line(json_line(obj))

    def append_line(self, line: str) -> None:
        """One whole line at the end, never through a link (open_run_file)."""
        with open_run_file(self.path, "a") as f:
            f.write(line + "\n")


def step_line(path: Path, step: int) -> str | None:
    """The last line of a log, without its newline, when it is a whole line of `step` (what a checkpoint
    keeps of the step it saves); None otherwise. Reads the file's end only: a log can be long."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        size, back = f.seek(0, os.SEEK_END), 1 << 16
        while True:
            start = max(0, size - back)
            f.seek(start)
            data = f.read()
            if not data.endswith(b"\n"):
                return None  # empty, or a torn last line
            lines = data[:-1].split(b"\n")
            if len(lines) > 1 or start == 0:
                break
            back *= 4  # a line longer than what was read: read further back
    line = lines[-1].decode("utf-8", errors="replace")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return line if isinstance(obj, dict) and obj.get("step") == step else None


def read_jsonl(path: Path) -> list[dict]:
    """A log's objects (a torn last line, the step a crash cut short, is left out)."""
    return _parse_lines(path)[1] if path.exists() else []


# the optional loggers: (flag, package to import, pip extra)
_LOGGER_PACKAGES = {"wandb": ("--wandb", "wandb"), "tensorboard": ("--tensorboard", "tensorboard")}


def check_logger_packages(wandb_project: str = "", tensorboard: bool = False) -> None:
    """Refuse --wandb / --tensorboard without their package before any model loads (ValueError: one line,
    with the pip line that fixes it), not with a traceback after it has."""
    for extra, asked in (("wandb", bool(wandb_project)), ("tensorboard", tensorboard)):
        flag, package = _LOGGER_PACKAGES[extra]
        if not asked:
            continue
        try:
            importlib.import_module(package)
        except ImportError as e:
            raise ValueError(
                f"{flag} needs the {package} package, which is not installed: pip install -e '.[{extra}]' "
                f"(or pip install {package}), or drop {flag}"
            ) from e


class Logger:
    """Console + JSONL + optional W&B / TensorBoard for one run folder.

    W&B and TensorBoard get every numeric metric of a step; every `log_samples_every` steps, the step's
    completions (W&B: the table `samples`; TensorBoard: the text `samples`, a markdown table); at close,
    W&B also gets the run page (index.html) as an artifact of type `run-page`."""

    check_packages = staticmethod(check_logger_packages)  # train.py: before any model loads

    def __init__(
        self,
        out_dir: Path,
        enabled: bool = True,
        wandb_project: str = "",
        tensorboard: bool = False,
        config=None,
    ):
        self.out_dir, self.enabled = out_dir, enabled
        self.metrics = JsonlWriter(out_dir / "metrics.jsonl")
        self.samples = JsonlWriter(out_dir / "samples.jsonl")
        self._wandb = self._tb = None
        if not enabled:
            return
        check_logger_packages(wandb_project, tensorboard)  # for callers that did not check at start-up
        if wandb_project:
            import wandb  # only when asked for

            self._wandb = wandb.init(project=wandb_project, dir=str(out_dir), config=config)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tb"))

    def truncate_after(self, step: int) -> dict[str, int]:
        """Cut both logs back to `step`: {file name: lines dropped} (empty on the ranks that do not log)."""
        if not self.enabled:
            return {}
        if (
            self._tb is not None
        ):  # TensorBoard hides the events after `step`: the steps run again replace them
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(str(self.out_dir / "tb"), purge_step=step + 1)
        return {w.path.name: w.truncate_after(step) for w in (self.metrics, self.samples)}

    def restore_line(self, step: int, line: str | None) -> bool:
        """After truncate_after(step): put back metrics.jsonl's line of `step` from the checkpoint's copy
        (`line`) when the log lost it (a torn or unsynced write); True when it did."""
        if not self.enabled or line is None or self.metrics.has_step(step):
            return False
        self.metrics.append_line(line)
        return True

    def log(self, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.metrics.write(m)
        nums = {
            k: json_safe(v) for k, v in m.items() if isinstance(json_safe(v), (int, float)) and k != "step"
        }
        if self._wandb is not None:
            self._wandb.log(nums, step=m["step"])
        if self._tb is not None:
            for k, v in nums.items():
                self._tb.add_scalar(k, v, m["step"])

    def log_samples(self, step: int, groups: list[dict]) -> None:
        """samples.jsonl, and the completions table to W&B / TensorBoard."""
        if not self.enabled:
            return
        from nanogrpo.infra.sample_table import sample_rows, samples_markdown

        self.samples.write({"step": step, "groups": groups})
        if self._wandb is not None:
            import wandb

            graders, rows = sample_rows(groups)
            columns = ["prompt", "completion", *graders, "advantage", "reward"]
            table = wandb.Table(columns=columns, data=rows, allow_mixed_types=True)
            self._wandb.log({"samples": table}, step=step)
        if self._tb is not None:
            self._tb.add_text("samples", samples_markdown(groups), step)
            self._tb.flush()

    def close(self) -> None:
        if self._wandb is not None:
            page = self.out_dir / "index.html"
            if page.exists():  # the run page, written just before close
                import wandb

                art = wandb.Artifact(f"run-page-{self._wandb.id}", type="run-page")
                art.add_file(str(page), name="index.html")
                self._wandb.log_artifact(art)
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
