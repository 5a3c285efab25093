"""`VLLMEngine`: the rollout-engine interface over a vLLM server's `/v1/completions`.

Every request sends token ids (never text) and asks for the ids and log-probabilities of what was
sampled:

    {"model": "policy-v3", "prompt": [ids], "max_tokens": n, "temperature": T, "top_p": p,
     "seed": s, "stop_token_ids": [...], "ignore_eos": true, "logprobs": 0,
     "return_token_ids": true, "return_tokens_as_token_ids": true,
     "skip_special_tokens": false, "include_stop_str_in_output": true}

* Sessions live client-side: a session is its token list, and each turn resends the whole
  context (on CUDA vLLM's prefix cache turns the repeated prefix into a cache hit; the CPU server
  runs without it, see `server_command`).
* `logprobs` are the server's sampled-token log-probabilities, which are the RAW model
  distribution only because the server runs with `--logprobs-mode raw_logprobs` (`VLLMServer`
  does). vLLM returns one kind per server, so `sampling_logprobs` (the processed distribution) is
  filled as: 0.0 for greedy, the raw value when temperature is 1 and top_p is 1 (the distributions
  coincide), and NaN otherwise (not available from this server).
* Only `stop_token_ids` end a turn ("stop"; the stop token is part of the output, as in
  `JaxEngine`): `ignore_eos` keeps vLLM from also stopping at the tokenizer's EOS.
* Row i of a call is sampled with seed `params.seed + i`; each row is its own request, sent from a
  thread pool of `concurrency` workers. vLLM batches concurrent requests itself.
* Transport failures (refused, reset, timeouts) and 5xx replies are retried `retries` times with
  exponential backoff; then, like a 4xx or a reply that does not parse, they raise `EngineError`
  with a `kind` ("unreachable", "timeout", "server_error", "rejected", "malformed") the trainer
  counts. A failed call leaves the sessions as they were.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from jaxpi.rollout.engine import Completion, SamplingParams, Session

ERROR_KINDS = ("unreachable", "timeout", "server_error", "rejected", "malformed")


class EngineError(RuntimeError):
    """A request that failed for good; `kind` is one of ERROR_KINDS."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclasses.dataclass(frozen=True)
class VLLMEngineConfig:
    url: str
    max_len: int = 2048  # session length cap, as JaxEngine's max_len (<= the server's max-model-len)
    batch_size: int = 64  # live sessions the collector may open at once (the wave size)
    concurrency: int = 16  # requests in flight
    timeout_s: float = 120.0  # per request
    retries: int = 2  # after the first try
    backoff_s: float = 0.5  # first wait; doubles per retry (with jitter)

    def __post_init__(self) -> None:
        errors = []
        if not self.url.startswith(("http://", "https://")):
            errors.append(f"url must start with http:// or https://, got {self.url!r}")
        if self.max_len < 2 or self.batch_size < 1 or self.concurrency < 1:
            errors.append(
                f"max_len >= 2, batch_size >= 1, concurrency >= 1 required, got "
                f"{self.max_len}, {self.batch_size}, {self.concurrency}"
            )
        if self.timeout_s <= 0 or self.retries < 0 or self.backoff_s < 0:
            errors.append(
                f"timeout_s > 0, retries >= 0, backoff_s >= 0 required, got "
                f"{self.timeout_s}, {self.retries}, {self.backoff_s}"
            )
        if errors:
            raise ValueError("; ".join(errors))


def completion_request(
    model: str, prompt: Sequence[int], params: SamplingParams, max_tokens: int, seed: int
) -> dict[str, Any]:
    """The `/v1/completions` body for one row (see the module docstring)."""
    return {
        "model": model,
        "prompt": [int(t) for t in prompt],
        "max_tokens": int(max_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "seed": int(seed),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "n": 1,
        "stream": False,
    }


def parse_completion(body: Any, params: SamplingParams, prompt_len: int) -> Completion:
    """A `/v1/completions` reply → `Completion`; anything missing or inconsistent is `EngineError("malformed")`."""

    def bad(why: str) -> EngineError:
        return EngineError("malformed", f"completion reply {why}")

    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise bad("has no choices[0]") from None
    ids = choice.get("token_ids")
    lp = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(ids, list) or not isinstance(lp, list):
        raise bad("lacks token_ids or logprobs.token_logprobs (server too old, or logprobs not enabled)")
    if len(ids) != len(lp):
        raise bad(f"has {len(ids)} token ids but {len(lp)} logprobs")
    try:
        ids = [int(t) for t in ids]
        lp = [float(x) for x in lp]
    except (TypeError, ValueError):
        raise bad("holds non-numeric token ids or logprobs") from None
    if any(not math.isfinite(x) or x > 1e-6 for x in lp):
        raise bad("holds a logprob that is not a finite number <= 0")
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise bad(f"has finish_reason {reason!r}")
    if reason == "stop" and (not ids or ids[-1] not in params.stop_token_ids):
        # vLLM also says "stop" for stop strings and EOS; we ask for neither, so this is an error.
        raise bad("stopped without a requested stop token at the end")
    if params.temperature == 0:
        sampling = [0.0] * len(lp)
    elif params.temperature == 1.0 and params.top_p == 1.0:
        sampling = list(lp)
    else:
        sampling = [math.nan] * len(lp)
    return Completion(ids, lp, sampling, reason, prompt_len)


class VLLMEngine:
    """RolloutEngine over a vLLM server; `set_policy` chooses the served adapter for later calls."""

    def __init__(self, cfg: VLLMEngineConfig, model: str = "base", policy_version: int = 0) -> None:
        self.cfg = cfg
        self.model, self.policy_version = model, policy_version
        self.max_len, self.batch_size = cfg.max_len, cfg.batch_size
        self._sessions: dict[int, list[int]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.base_model = model  # the served base (what the probe compares adapters against)
        self._client = self._make_client(cfg.url)
        self._pool = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="vllm-engine")
        self.requests_done = 0  # completed completion requests (tests watch it)

    def _make_client(self, url: str) -> httpx.Client:
        return httpx.Client(
            base_url=url.rstrip("/"),
            timeout=httpx.Timeout(self.cfg.timeout_s, connect=min(10.0, self.cfg.timeout_s)),
            limits=httpx.Limits(max_connections=self.cfg.concurrency),
        )

    def rebind(self, url: str) -> None:
        """Talk to a server at another address (a restarted server on a new port)."""
        old, self.cfg = self._client, dataclasses.replace(self.cfg, url=url)
        self._client = self._make_client(url)
        old.close()

    # ---- policy ----------------------------------------------------------------------------------
    def set_policy(self, model: str, version: int) -> None:
        """Send later requests to the served model (or adapter) `model`, produced by `version`."""
        self.model, self.policy_version = model, int(version)

    def load_adapter(self, path: str, version: int, *, switch: bool = True) -> str:
        """Load the peft adapter at `path` (on the server's filesystem) as "policy-v{version}",
        replacing one of that name; with `switch`, later requests use it (the JaxEngine's
        `update_weights`). Unverified: `jaxpi.vllm.sync.AdapterSync` probes before switching."""
        name = f"policy-v{version}"
        try:
            self.post("/v1/unload_lora_adapter", {"lora_name": name}, expect_json=False)
        except EngineError as e:
            if e.kind != "rejected":  # 404 "cannot be found": nothing to replace
                raise
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, expect_json=False)
        if switch:
            self.set_policy(name, version)
        return name

    # ---- the interface ---------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        contexts = [[int(t) for t in p] for p in prompts]
        return self._turns(contexts, params)

    def start(self, prompts: Sequence[Sequence[int]]) -> list[Session]:
        out = []
        for i, p in enumerate(prompts):
            if len(p) > self.max_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens, more than max_len={self.max_len}")
            with self._lock:
                sid = next(self._ids)
                self._sessions[sid] = [int(t) for t in p]
            out.append(Session(sid))
        return out

    def continue_(
        self, sessions: Sequence[Session], observations: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        if len(sessions) != len(observations):
            raise ValueError(f"{len(sessions)} sessions but {len(observations)} observations")
        contexts = []
        for s, obs in zip(sessions, observations, strict=True):
            if s.id not in self._sessions:
                raise ValueError(f"session {s.id} is closed or unknown")
            ctx = self._sessions[s.id] + [int(t) for t in obs]
            if len(ctx) > self.max_len:
                raise ValueError(
                    f"session {s.id}: {len(ctx)} tokens of context exceed max_len={self.max_len}"
                )
            contexts.append(ctx)
        comps = self._turns(contexts, params)
        # Only after every row succeeded: a failed call leaves the sessions untouched.
        for s, ctx, c in zip(sessions, contexts, comps, strict=True):
            self._sessions[s.id] = ctx + c.token_ids
        return comps

    def close(self, sessions: Sequence[Session]) -> None:
        for s in sessions:
            self._sessions.pop(s.id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # ---- requests --------------------------------------------------------------------------------
    def _turns(self, contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
        model = self.model
        futures = [
            self._pool.submit(self._one, model, ctx, params, params.seed + i)
            for i, ctx in enumerate(contexts)
        ]
        results, first_error = [], None
        for f in futures:
            try:
                results.append(f.result())
            except EngineError as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return results

    def _one(self, model: str, ctx: list[int], params: SamplingParams, seed: int) -> Completion:
        room = self.max_len - len(ctx)
        if room < 1:
            return Completion([], [], [], "length", len(ctx))
        body = completion_request(model, ctx, params, min(params.max_new_tokens, room), seed)
        reply = self.post("/v1/completions", body)
        comp = parse_completion(reply, params, len(ctx))
        with self._lock:
            self.requests_done += 1
        return comp

    def post(self, path: str, body: dict[str, Any], *, expect_json: bool = True) -> Any:
        """POST JSON with the engine's retries; the parsed reply (the text when not `expect_json`:
        vLLM's adapter endpoints answer in plain text), or `EngineError`."""
        last: EngineError | None = None
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(self.cfg.backoff_s * 2 ** (attempt - 1) * (1 + 0.25 * random.random()))
            try:
                r = self._client.post(path, json=body)
            except httpx.TimeoutException as e:
                last = EngineError("timeout", f"{path} after {self.cfg.timeout_s:.0f} s ({type(e).__name__})")
                continue
            except httpx.TransportError as e:
                last = EngineError("unreachable", f"{self.cfg.url}{path}: {type(e).__name__}: {e}")
                continue
            if r.status_code >= 500:
                last = EngineError("server_error", f"{path} -> HTTP {r.status_code}: {r.text[:300]}")
                continue
            if r.status_code >= 400:
                raise EngineError("rejected", f"{path} -> HTTP {r.status_code}: {r.text[:500]}")
            if not expect_json:
                return r.text
            try:
                return r.json()
            except ValueError:
                raise EngineError("malformed", f"{path} replied with non-JSON: {r.text[:200]!r}") from None
        assert last is not None
        raise last
