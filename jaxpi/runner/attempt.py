"""One Pi attempt at a task, in the sandbox, scored by the task's verifier (`run_attempt`); many at
once on a small pool (`run_attempts`).

Per attempt, under a private root:

    <root>/<attempt>/ws     a fresh workspace from the task (`jaxpi.tasks.run.new_workspace`)
    <root>/<attempt>/home   Pi's agent dir (models.json -> the gateway, the attempt's token as API key)

and inside the sandbox (`jaxpi.sandbox.run_sandboxed`):

    /workspace              the workspace, writable, Pi's working directory
    /pi                     the agent dir, writable (Pi writes its session file to /pi/sessions)
    <prefix>                Pi's npm prefix with its own Node.js, read-only at its host path
    /opt/jaxpi/pi_extension.js   turn / token limits and sampling settings, read-only
    127.0.0.1:<port>        the gateway, the only network destination

Pi runs as `node cli.js --print --mode json --thinking LEVEL ... "<instruction>"` with every
discovery switched off (extensions, skills, prompt templates, themes, AGENTS.md) and offline, so
an attempt sees nothing but the task. After Pi ends, its session file and event stream are copied
to `out_dir`, the verifier runs in a second sandbox over the same workspace, and one
`AttemptRecord` says how it went (see `jaxpi.runner.record` for the reasons).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from jaxpi.atomic import write_text
from jaxpi.runner.events import summarize_events
from jaxpi.runner.install import PiInstall, find_pi
from jaxpi.runner.pi_config import LEVELS, PROVIDER, write_pi_home
from jaxpi.runner.record import AttemptRecord, read_session_summary
from jaxpi.sandbox import SandboxConfig, run_sandboxed
from jaxpi.sandbox.stage import UnsafeCopyError, copy_file_out
from jaxpi.tasks.run import new_workspace, run_verifier
from jaxpi.tasks.task import Task

EXTENSION_JS = Path(__file__).with_name("pi_extension.js")
# A session this large is not one Pi wrote within an attempt's token budget: it is refused.
MAX_SESSION_BYTES = 64 << 20
_HOME = "/pi"
_EXTENSION_INSIDE = "/opt/jaxpi/pi_extension.js"
# The gateway's trace of an attempt: attempt id -> its recorded calls (dicts), or None if unknown.
TraceFn = Callable[[str], Sequence[dict] | None]
# The API key Pi sends for an attempt: attempt id -> the token the gateway issued for it.
KeyFn = Callable[[str], str]


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """How attempts run. Zero means "the task's own limit" for the three task limits."""

    model_id: str = "policy"  # the model name Pi asks the server for
    context_window: int = 32768  # what Pi is told about the model (it trims nothing below it)
    max_tokens_per_call: int = 4096  # max_tokens of each model call
    wall_seconds: float = 0.0  # whole attempt (Pi); 0 = task.limits.wall_seconds
    max_turns: int = 0  # 0 = task.limits.max_turns
    max_tokens: int = 0  # output tokens of the attempt; 0 = task.limits.max_tokens
    pi_memory_mb: int = 1024  # added to the task's memory limit: node and Pi live in the same sandbox
    pi_procs: int = 64  # added to the task's process limit (node's threads count)
    jobs: int = 2  # attempts at once in run_attempts
    # Pi's tool allowlist (`--tools`); () = Pi's default set (read, bash, edit, write).
    tools: tuple[str, ...] = ()
    # Sampling of every model call (None = the server's defaults); call k of an attempt gets seed + k.
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        errors = []
        for name in ("context_window", "max_tokens_per_call", "pi_memory_mb", "pi_procs", "jobs"):
            if getattr(self, name) < 1:
                errors.append(f"runner.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("wall_seconds", "max_turns", "max_tokens"):
            if getattr(self, name) < 0:
                errors.append(f"runner.{name} must be >= 0 (0 = the task's limit), got {getattr(self, name)}")
        if self.temperature is not None and not self.temperature >= 0:
            errors.append(f"runner.temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            errors.append(f"runner.top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "tools", tuple(self.tools))
        if errors:
            raise ValueError("; ".join(errors))


def _endpoint(url: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname or not u.port:
        raise ValueError(f"endpoint must be http://HOST:PORT[/v1], got {url!r}")
    return u.hostname, u.port


def _inside_url(url: str) -> str:
    """The endpoint as the sandbox sees it: the relay listens on 127.0.0.1 at the same port."""
    u = urllib.parse.urlsplit(url)
    path = u.path.rstrip("/") or "/v1"
    return f"http://127.0.0.1:{u.port}{path}"


def pi_argv(pi: PiInstall, task: Task, level: str, model_id: str, tools: Sequence[str] = ()) -> list[str]:
    """Pi's command line inside the sandbox (pure)."""
    text = task.instruction.strip()
    # Pi reads a leading "@" as a file to attach and a leading "-" as an option.
    if text.startswith(("@", "-")):
        text = "Task: " + text
    return [
        str(pi.node),
        str(pi.cli_js),
        "--print",
        "--mode",
        "json",
        "--provider",
        PROVIDER,
        "--model",
        model_id,
        "--thinking",
        level,
        "--session-dir",
        f"{_HOME}/sessions",
        # Discovery off: an attempt sees the task and nothing of the host or of the user's own Pi.
        "--no-extensions",
        "-e",
        _EXTENSION_INSIDE,
        "--no-skills",
        "--no-prompt-templates",
        "--no-themes",
        "--no-context-files",
        # No update check or telemetry at start-up: nothing but the gateway is reachable anyway,
        # and each failed lookup would cost the attempt seconds.
        "--offline",
        *pi.release.extra_flags,
        *(["--tools", ",".join(tools)] if tools else []),
        text,
    ]


def _sandbox_config(task: Task, cfg: RunnerConfig, endpoint: tuple[str, int], pi: PiInstall) -> SandboxConfig:
    lim = task.limits
    wall = cfg.wall_seconds or lim.wall_seconds
    return SandboxConfig(
        # RLIMIT_CPU is per process: node's own CPU time over a whole attempt must fit.
        cpu_seconds=max(lim.cpu_seconds, int(wall) + 1),
        # node + Pi are resident themselves (~200-400 MB); the task's budget is for what the model runs.
        memory_mb=lim.memory_mb + cfg.pi_memory_mb,
        max_procs=lim.max_procs + cfg.pi_procs,
        disk_mb=lim.disk_mb,  # the workspace and Pi's home (its session) together
        wall_seconds=wall,
        endpoints=(endpoint,),
        ro_binds=(str(pi.prefix),),
        tmp_mb=512,  # HOME is /tmp: node and Pi keep caches there
    )


def _copy_session(home: Path, out_dir: Path) -> Path | None:
    """Copy Pi's session file out of `home` (the sandbox wrote it: anything may be there).

    Pi names it <timestamp>_<id>.jsonl under a directory derived from the cwd; one attempt, one
    session: the last name. The walk and the open go through directory descriptors without
    following symlinks, and the file must be a regular file with one link on home's file system
    and at most MAX_SESSION_BYTES (`jaxpi.sandbox.stage.open_beneath`); otherwise ValueError
    (nothing is written). None when there is no session at all.
    """
    root = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            sessions = os.open("sessions", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root)
        except FileNotFoundError:
            return None
        except OSError as e:
            kind = "a symlink" if os.path.islink(home / "sessions") else "not a directory"
            raise UnsafeCopyError(f"{home / 'sessions'}: {kind} ({e.strerror})") from None
        try:
            found = sorted(
                os.path.relpath(os.path.join(d, f), ".")
                for d, _, files, _ in os.fwalk(".", dir_fd=sessions)
                for f in files
                if f.endswith(".jsonl")
            )
        finally:
            os.close(sessions)
    finally:
        os.close(root)
    if not found:
        return None
    dst = out_dir / "session.jsonl"
    copy_file_out(str(home), f"sessions/{found[-1]}", str(dst), MAX_SESSION_BYTES)
    return dst


def _trace_counts(calls: Sequence[dict]) -> tuple[int | None, int | None]:
    """(output tokens, reasoning tokens) summed over the gateway's call records, when they say."""
    out = [c.get("completion_tokens", c.get("output_tokens")) for c in calls]
    rsn = [c.get("reasoning_tokens") for c in calls]
    total_out = sum(int(x) for x in out) if calls and all(isinstance(x, int) for x in out) else None
    total_rsn = sum(int(x) for x in rsn) if calls and all(isinstance(x, int) for x in rsn) else None
    return total_out, total_rsn


def run_attempt(
    task: Task,
    level: str,
    endpoint_url: str,
    attempt_id: str,
    *,
    out_dir: str | Path,
    cfg: RunnerConfig | None = None,
    trace: TraceFn | None = None,
    key: KeyFn | None = None,
    root: str | Path | None = None,
    pi: PiInstall | None = None,
    seed: int | None = None,
) -> AttemptRecord:
    """Run Pi once on `task` at thinking `level` against `endpoint_url` (the gateway, `.../v1`).

    `key(attempt_id)` is Pi's API key: the token the gateway issues for the attempt, under which
    it files the attempt's calls (default: the attempt id itself). `out_dir` receives session.jsonl,
    events.jsonl, verifier.txt and record.json. `trace(attempt_id)` returns the gateway's call
    records after the run (token counts come from them when present). `root` is where the
    workspace and config home are made (default: a private temp dir, removed afterwards).
    `seed` seeds the attempt's first model call (default `cfg.seed`).
    """
    cfg = cfg or RunnerConfig()
    if level not in LEVELS:
        raise ValueError(f"thinking level must be one of {LEVELS}, got {level!r}")
    pi = pi or find_pi()
    endpoint = _endpoint(endpoint_url)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    own_root = root is None
    base = Path(tempfile.mkdtemp(prefix="jaxpi-attempt-")) if own_root else Path(root)
    base.chmod(0o711)
    try:
        seed = cfg.seed if seed is None else seed
        api_key = key(attempt_id) if key is not None else attempt_id
        rec = _run(task, level, endpoint_url, endpoint, attempt_id, out, cfg, trace, base, pi, seed, api_key)
    finally:
        if own_root:
            shutil.rmtree(base, ignore_errors=True)
    write_text(out / "record.json", json.dumps(rec.to_json(with_calls=True), indent=2))
    return rec


def _run(
    task: Task,
    level: str,
    url: str,
    endpoint: tuple[str, int],
    attempt_id: str,
    out: Path,
    cfg: RunnerConfig,
    trace: TraceFn | None,
    base: Path,
    pi: PiInstall,
    seed: int | None,
    api_key: str,
) -> AttemptRecord:
    ws = new_workspace(task, base)
    home = write_pi_home(
        Path(tempfile.mkdtemp(prefix="home-", dir=base)),
        base_url=_inside_url(url),
        api_key=api_key,
        model_id=cfg.model_id,
        level=level,
        context_window=cfg.context_window + pi.release.context_margin,
        max_tokens=cfg.max_tokens_per_call,
    )
    sb = _sandbox_config(task, cfg, endpoint, pi)
    settings = {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "seed": seed,
        "max_turns": cfg.max_turns or task.limits.max_turns,  # = model calls: Pi makes one per turn
        "max_tokens": cfg.max_tokens or task.limits.max_tokens,
        "max_tokens_per_call": cfg.max_tokens_per_call,
        "wall_seconds": sb.wall_seconds,
        "context_window": cfg.context_window,
        "tools": list(cfg.tools) or None,
    }
    env = {
        "PI_CODING_AGENT_DIR": _HOME,
        "PI_OFFLINE": "1",
        "PI_SKIP_VERSION_CHECK": "1",
        "PI_TELEMETRY": "0",
        "JAXPI_MAX_TURNS": str(settings["max_turns"]),
        "JAXPI_MAX_TOKENS": str(settings["max_tokens"]),
    }
    for key, v in (("JAXPI_TEMPERATURE", cfg.temperature), ("JAXPI_TOP_P", cfg.top_p), ("JAXPI_SEED", seed)):
        if v is not None:
            env[key] = repr(v)
    t0 = time.monotonic()
    res = run_sandboxed(
        pi_argv(pi, task, level, cfg.model_id, cfg.tools),
        ws,
        sb,
        env=env,
        mounts={_EXTENSION_INSIDE: EXTENSION_JS},
        rw_mounts={_HOME: home},
    )
    wall = time.monotonic() - t0
    write_text(out / "events.jsonl", res.stdout)
    write_text(out / "pi_stderr.txt", res.stderr)
    try:
        session, unsafe = _copy_session(home, out), None
    except ValueError as e:  # planted by something in the sandbox: nothing was copied
        session, unsafe = None, str(e)
    calls = tuple(trace(attempt_id) or ()) if trace is not None else ()
    common = {
        "attempt_id": attempt_id,
        "task_id": task.id,
        "level": level,
        "wall_seconds": wall,
        "pi_returncode": res.returncode,
        "session_path": str(session) if session else None,
        "events_path": str(out / "events.jsonl"),
        "calls": calls,
        "model_calls": len(calls),
        "tool_errors": summarize_events(res.stdout.encode("utf-8", "replace")).tool_errors,
        "pi": f"{pi.release.package}@{pi.version}",
        "settings": settings,
    }

    def reject(
        reason: str, detail: str, turns: int = 0, output: int = 0, reasoning: int = 0
    ) -> AttemptRecord:
        return AttemptRecord(
            admitted=False,
            success=False,
            reason=reason,
            finish=None,
            turns=turns,
            output_tokens=output,
            reasoning_tokens=reasoning,
            detail=detail,
            **common,
        )

    summary = None
    if unsafe is not None:
        return reject("malformed_session", f"session file refused: {unsafe}")
    if session is not None:
        try:
            summary = read_session_summary(session)
        except ValueError as e:
            return reject("malformed_session", str(e))
        common["tool_calls"] = dict(summary.tool_calls_by_name)
        if trace is None:  # no gateway records: each assistant turn of the session was one call
            common["model_calls"] = summary.turns
    # The gateway's records are the exact sampled ids; the session's usage is only the server's count.
    t_out, t_rsn = _trace_counts(calls)
    turns = summary.turns if summary else len(calls)
    output = t_out if t_out is not None else (summary.output_tokens if summary else 0)
    reasoning = t_rsn or 0
    # A killed sandbox wins over whatever the session says: it may end mid-attempt yet read fine.
    if res.killed_reason == "wall":
        return reject("timeout", f"Pi ran past {sb.wall_seconds:.0f} s", turns, output, reasoning)
    if res.killed_reason is not None:
        return reject("sandbox_limit", f"sandbox {res.killed_reason} limit", turns, output, reasoning)
    if summary is not None and summary.error is not None:
        return reject("upstream_error", summary.error.splitlines()[0][:500], turns, output, reasoning)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["(no stderr)"])[-1][:500]
        return reject("pi_error", f"pi exited {res.returncode}: {tail}", turns, output, reasoning)
    if summary is None or summary.turns == 0:
        return reject(
            "malformed_session", "Pi left no session with an assistant turn", turns, output, reasoning
        )
    ver = run_verifier(task, ws)
    write_text(
        out / "verifier.txt", f"exit {ver.returncode}\n--- stdout\n{ver.stdout}\n--- stderr\n{ver.stderr}"
    )
    if ver.killed_reason is not None:
        return reject(
            "verifier_error", f"verifier hit its {ver.killed_reason} limit", turns, output, reasoning
        )
    if ver.returncode in (126, 127):  # bash could not run the test script at all
        return reject("verifier_error", f"verifier exited {ver.returncode}", turns, output, reasoning)
    finish = summary.limit or ("length" if summary.last_stop == "length" else "answer")
    # The verifier's outcome beside the session, where the session reader looks for it (a sidecar,
    # `jaxpi.data.sessions`): an evaluation's or a collection's attempts feed `jaxpi data check` and
    # `jaxpi sft` as they are.
    meta = {"task_id": task.id, "verified": ver.returncode == 0, "effort": level}
    write_text(out / (session.name + ".meta.json"), json.dumps(meta))
    return AttemptRecord(
        admitted=True,
        # An attempt cut at a limit is scored like any other: the verifier looks at the workspace.
        success=ver.returncode == 0,
        reason=None,
        finish=finish,
        turns=turns,
        output_tokens=output,
        reasoning_tokens=reasoning,
        verifier_returncode=ver.returncode,
        detail="" if finish == "answer" else f"stopped at {finish}",
        **common,
    )


def run_attempts(
    jobs: Sequence[tuple[Task, str, str]],
    endpoint_url: str,
    out_dir: str | Path,
    *,
    cfg: RunnerConfig | None = None,
    trace: TraceFn | None = None,
    key: KeyFn | None = None,
    progress: Callable[[AttemptRecord], Any] | None = None,
) -> list[AttemptRecord]:
    """Run (task, level, attempt_id) jobs on a pool of `cfg.jobs`; records in the jobs' order.

    Each attempt writes into `out_dir/<attempt_id>/`. `progress(record)` is called as each ends.
    `trace` and `key` are `run_attempt`'s.
    """
    cfg = cfg or RunnerConfig()
    pi = find_pi()
    ids = [a for _, _, a in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError("attempt ids must be unique (they key the gateway's records)")
    out = Path(out_dir)

    def one(i: int) -> AttemptRecord:
        task, level, attempt_id = jobs[i]
        # Attempts draw apart: call k of attempt i is seeded seed + 1000 i + k.
        seed = None if cfg.seed is None else cfg.seed + 1000 * i
        rec = run_attempt(
            task,
            level,
            endpoint_url,
            attempt_id,
            out_dir=out / attempt_id,
            cfg=cfg,
            trace=trace,
            key=key,
            pi=pi,
            seed=seed,
        )
        if progress is not None:
            progress(rec)
        return rec

    # Threads suffice: each attempt is a subprocess tree, and run_sandboxed is safe in threaded callers.
    if cfg.jobs == 1 or len(jobs) <= 1:
        return [one(i) for i in range(len(jobs))]
    with ThreadPoolExecutor(max_workers=cfg.jobs) as pool:
        return list(pool.map(one, range(len(jobs))))
