"""One collection's trajectories as the padded arrays GRPO's loss reads (pure, host side).

Row i is trajectory i, left-aligned and right-padded to `length` (the batch layout of
`jaxpi.rl.loss`: every per-token array is indexed by the position of the token it is about):

    input_ids   [N, L] int32    the session's tokens, 0 after its end
    loss_mask   [N, L] int32    1 on the tokens the model sampled, 0 on prompt, observations, padding;
                                all 0 for an attempt that is not trained on (not admitted, unless
                                `supervised` says otherwise: `CollectionScore.scored`)
    logp_engine [N, L] float32  the engine's raw-model log-probability of each sampled token
    advantages  [N]    float32

Causal attention never looks right, so the padding cannot reach a real token and needs no
segment ids. Row lengths come in buckets (`bucket_length`) so a run compiles a few step
programs, not one per collection.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxpi.envs.agent_loop import Trajectory


def bucket_length(longest: int, bucket: int, cap: int) -> int:
    """The smallest multiple of `bucket` that holds `longest` tokens, at most `cap`."""
    if longest > cap:
        raise ValueError(f"a trajectory of {longest} tokens does not fit the {cap}-token rows")
    return min(cap, -(-max(longest, 1) // bucket) * bucket)


def trajectory_batch(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float],
    *,
    length: int,
    rows: int | None = None,
    supervised: Sequence[bool] | None = None,
) -> dict[str, np.ndarray]:
    """Arrays of the module docstring; `rows` (≥ len(trajectories)) pads with empty rows, which
    have no supervised token and so no weight in the loss. `supervised[i]` says whether
    trajectory i is trained on (default: whether it was admitted); the reward's `scored` mask
    also takes in malformed attempts scored as failures (`reward.malformed="fail"`)."""
    n = len(trajectories)
    rows = n if rows is None else rows
    if rows < n:
        raise ValueError(f"{n} trajectories do not fit {rows} rows")
    if len(advantages) != n:
        raise ValueError(f"{len(advantages)} advantages for {n} trajectories")
    train = [t.admitted for t in trajectories] if supervised is None else [bool(x) for x in supervised]
    if len(train) != n:
        raise ValueError(f"{len(train)} supervised flags for {n} trajectories")
    ids = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), np.int32)
    logp = np.zeros((rows, length), np.float32)
    adv = np.zeros((rows,), np.float32)
    for i, (t, a, on) in enumerate(zip(trajectories, advantages, train, strict=True)):
        k = len(t.token_ids)
        if k > length:
            raise ValueError(f"trajectory {t.attempt_id} has {k} tokens, rows hold {length}")
        if not (len(t.mask) == len(t.logprobs) == k):
            raise ValueError(
                f"trajectory {t.attempt_id}: token_ids, mask and logprobs differ in length "
                f"({k}, {len(t.mask)}, {len(t.logprobs)})"
            )
        ids[i, :k] = t.token_ids
        logp[i, :k] = t.logprobs
        if on:
            mask[i, :k] = t.mask
            adv[i] = a
    return {"input_ids": ids, "loss_mask": mask, "logp_engine": logp, "advantages": adv}
