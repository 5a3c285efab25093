"""Adapter sync: after each policy update, the trainer's adapter reaches vLLM and is verified.

    push(model, version)
        export    jaxpi.lora.peft.save_peft → <adapters_dir>/policy-v{N} (temp dir + rename)
        load      POST /v1/unload_lora_adapter {policy-v{N}} (a resumed run may reuse the name),
                  POST /v1/load_lora_adapter   {"lora_name": "policy-v{N}", "lora_path": dir}
        probe     vLLM's prompt log-probabilities of a fixed token sequence under policy-v{N}
                  (`prompt_logprobs`, one forward pass) against jaxpi's own for the same adapter
        retire    unload versions older than `keep` (what `max_staleness` can still admit)

The probe is the guard against a silently inert adapter: vLLM ignores adapter tensors whose names
match none of its modules (e.g. a Qwen3.5 adapter named for the conditional model,
`model.language_model.layers...`, on a text-only server) and then serves the base model as if
nothing were wrong. With

    err       = mean_t |served_t - jaxpi_adapter_t|      (must be <= tol: same numbers)
    effect    = mean_t |jaxpi_adapter_t - jaxpi_base_t|  (what the adapter should change)
    moved     = mean_t |served_t - served_base_t|        (what it did change on the server)

the verdicts are: "ok" (err <= tol, and moved > tol when effect > tol); "inert" (effect > tol but
moved <= tol: the server ignored the adapter → `AdapterProbeError`, naming the usual cause);
"mismatch" (err > tol otherwise: wrong adapter, wrong layout, wrong base → `AdapterProbeError`);
"inconclusive" (effect <= tol: the adapter is too close to the base for bf16 to tell, e.g. fresh
LoRA with B = 0; counted, not fatal). `tol` is the bf16-vs-fp32 noise measured in docs/vllm.md.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpi.vllm.engine import EngineError

# Measured on the tiny bf16 test model, CPU (docs/vllm.md): mean |vLLM bf16 - jaxpi fp32| of
# prompt log-probs is ~0.01 nats, max ~0.05; the default leaves a margin of about 3x on the mean.
PROBE_TOL = 0.03
PROBE_LEN = 48


class AdapterProbeError(RuntimeError):
    """The served adapter is not the trainer's adapter (or is ignored by the server)."""


def adapter_name(version: int) -> str:
    return f"policy-v{version}"


def probe_tokens(vocab_size: int, n: int = PROBE_LEN, seed: int = 1234) -> list[int]:
    """A fixed pseudo-random token sequence (any ids the model accepts will do for log-probs)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=n).tolist()


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    version: int
    verdict: str  # ok | inconclusive (raising verdicts never come back as results)
    err_mean: float
    err_max: float
    effect_mean: float
    moved_mean: float
    tol: float

    def metrics(self) -> dict[str, float]:
        return {
            "probe/err_mean": self.err_mean,
            "probe/err_max": self.err_max,
            "probe/effect_mean": self.effect_mean,
            "probe/moved_mean": self.moved_mean,
            "probe/inconclusive": float(self.verdict == "inconclusive"),
        }


def judge_probe(
    version: int,
    served: np.ndarray,
    expected: np.ndarray,
    served_base: np.ndarray,
    expected_base: np.ndarray,
    tol: float = PROBE_TOL,
) -> ProbeResult:
    """The verdict on one pushed adapter (pure; see the module docstring). Arrays are per-token
    log-probs of the probe's tokens 1..n-1 (token 0 has none)."""
    arrays = [np.asarray(a, np.float64) for a in (served, expected, served_base, expected_base)]
    if len({a.shape for a in arrays}) != 1:
        raise ValueError(f"probe arrays differ in shape: {[a.shape for a in arrays]}")
    served, expected, served_base, expected_base = arrays
    err = np.abs(served - expected)
    effect = float(np.mean(np.abs(expected - expected_base)))
    moved = float(np.mean(np.abs(served - served_base)))
    res = ProbeResult(version, "ok", float(err.mean()), float(err.max()), effect, moved, tol)
    name = adapter_name(version)
    if effect > tol and moved <= tol:
        raise AdapterProbeError(
            f"{name} is inert on the server: jaxpi says it moves the probe's log-probs by {effect:.4f} nats "
            f"(mean), vLLM's moved by {moved:.4f} (tolerance {tol}). vLLM ignores adapter tensors whose names "
            "match none of its modules: check the exported names' prefix against the served architecture "
            "(text-only Qwen3_5ForCausalLM wants base_model.model.model.layers..., the conditional model "
            "base_model.model.model.language_model.layers...; jaxpi export takes it from the base config.json)"
        )
    if res.err_mean > tol:
        raise AdapterProbeError(
            f"{name}: vLLM's probe log-probs differ from jaxpi's for the same adapter by {res.err_mean:.4f} "
            f"nats on average (max {res.err_max:.4f}; tolerance {tol}; the adapter moves them by "
            f"{effect:.4f}): the server is not running the trainer's policy (another base, a layout "
            "error in the export, or a stale adapter under this name)"
        )
    if effect <= tol:
        return dataclasses.replace(res, verdict="inconclusive")
    return res


def stale(policy_versions: Sequence[int], current: int, max_staleness: int) -> list[bool]:
    """Which attempts are too old to admit: produced more than `max_staleness` versions ago."""
    return [current - int(v) > max_staleness for v in policy_versions]


class AdapterSync:
    """Push, probe and retire adapters on one server through a `VLLMEngine` (its `post` retries).

    `expected_logprobs(train_state_or_None, ids)` is the trainer's own scorer: the per-token
    log-probs `[len(ids)]` of `ids` under the adapter (None = the base, i.e. zero adapter).
    """

    def __init__(
        self,
        engine: Any,
        adapters_dir: str | Path,
        base_dir: str | Path,
        lora_cfg: Any,
        vocab_size: int,
        *,
        tol: float = PROBE_TOL,
        keep: int = 1,
        log: Callable[[str], None] = print,
    ) -> None:
        self.engine, self.dir = engine, Path(adapters_dir)
        self.base_dir, self.lora_cfg, self.tol, self.keep, self.log = Path(base_dir), lora_cfg, tol, keep, log
        self.probe = probe_tokens(vocab_size)
        self.loaded: list[int] = []
        self._served_base: np.ndarray | None = None

    # ---- the server ------------------------------------------------------------------------------
    def prompt_logprobs(self, model: str, ids: Sequence[int]) -> np.ndarray:
        """vLLM's log π(ids[t] | ids[<t]) for t = 1..n-1, from `prompt_logprobs` (one forward pass)."""
        body = {
            "model": model,
            "prompt": [int(t) for t in ids],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        reply = self.engine.post("/v1/completions", body)
        try:
            plp = reply["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise EngineError("malformed", "completion reply has no choices[0].prompt_logprobs") from None
        return parse_prompt_logprobs(plp, ids)

    def load(self, version: int, path: Path) -> None:
        self.engine.load_adapter(str(path), version, switch=False)
        self.loaded.append(version)

    def unload(self, version: int, *, quiet: bool = False) -> None:
        try:
            self.engine.post(
                "/v1/unload_lora_adapter", {"lora_name": adapter_name(version)}, expect_json=False
            )
        except EngineError as e:
            if not (quiet and e.kind == "rejected"):  # "not loaded" is a 4xx: fine when clearing
                raise
        if version in self.loaded:
            self.loaded.remove(version)

    def forget_server(self) -> None:
        """After a server restart: nothing is loaded there any more."""
        self.loaded.clear()
        self._served_base = None

    # ---- one version -----------------------------------------------------------------------------
    def export(self, model: Any, version: int) -> Path:
        from jaxpi.lora.peft import save_peft

        out = self.dir / adapter_name(version)
        return save_peft(model, self.lora_cfg, out, base_dir=self.base_dir, overwrite=True)

    def push(self, model: Any, version: int, expected: np.ndarray, expected_base: np.ndarray) -> ProbeResult:
        """Export, load, probe (raises `AdapterProbeError`), retire old versions, point the engine at it."""
        path = self.export(model, version)
        return self.push_dir(path, version, expected, expected_base)

    def push_dir(
        self, path: Path, version: int, expected: np.ndarray, expected_base: np.ndarray
    ) -> ProbeResult:
        self.load(version, path)
        if self._served_base is None:
            self._served_base = self.prompt_logprobs(self.engine_base(), self.probe)
        served = self.prompt_logprobs(adapter_name(version), self.probe)
        result = judge_probe(version, served, expected, self._served_base, expected_base, self.tol)
        for old in [v for v in self.loaded if v < version - self.keep]:
            self.unload(old, quiet=True)
            shutil.rmtree(self.dir / adapter_name(old), ignore_errors=True)
        self.engine.set_policy(adapter_name(version), version)
        self.log(
            f"{adapter_name(version)} loaded: probe {result.verdict} (vLLM vs jaxpi {result.err_mean:.4f} "
            f"mean / {result.err_max:.4f} max nats; adapter effect {result.effect_mean:.4f}, on server "
            f"{result.moved_mean:.4f}; tol {self.tol})"
        )
        return result

    def engine_base(self) -> str:
        return getattr(self.engine, "base_model", "base")


def parse_prompt_logprobs(plp: Any, ids: Sequence[int]) -> np.ndarray:
    """vLLM's `prompt_logprobs` (a list: None, then per position a dict keyed by token id, each
    entry's `logprob`) → the log-probs of `ids[1:]`; a missing entry is `EngineError("malformed")`."""
    if not isinstance(plp, list) or len(plp) != len(ids):
        raise EngineError(
            "malformed",
            f"prompt_logprobs has {len(plp) if isinstance(plp, list) else plp!r} entries, want {len(ids)}",
        )
    out = np.zeros(len(ids) - 1, np.float64)
    for t in range(1, len(ids)):
        entry = plp[t] or {}
        hit = entry.get(str(ids[t]), entry.get(f"token_id:{ids[t]}"))
        if hit is None:
            raise EngineError(
                "malformed",
                f"prompt_logprobs[{t}] has no entry for token {ids[t]}: {json.dumps(entry)[:200]}",
            )
        out[t - 1] = float(hit["logprob"] if isinstance(hit, dict) else hit)
    return out
