"""The same LoRA step in `transformers` + `peft`, on the same checkpoint, tokens and threads.

`Qwen3_5ForCausalLM.from_pretrained` (SDPA attention, the library's default; the DeltaNet layers
run transformers' own torch fallbacks unless flash-linear-attention is installed), `peft` LoRA of
the same rank, alpha and target modules (adapter weights float32, as jaxpi's), `torch.optim.AdamW`
on the adapter, the next-token cross-entropy over all positions (jaxpi's loss, in float32).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxpi.bench.config import BenchConfig
from jaxpi.bench.timing import figure, rate, timed
from jaxpi.bench.train_step import LR
from jaxpi.convert.table import LINEAR_NAMES as ALL_LINEAR


def torch_versions() -> dict[str, str]:
    try:
        import peft
        import torch
        import transformers
    except ImportError as e:  # the parity / test extra
        return {"error": f"{e} (install jaxpi[parity] for --vs torch)"}
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


def torch_step_runner(
    bench: BenchConfig, ckpt: str | Path, ids: np.ndarray
) -> tuple[Callable[[], float], dict[str, Any]]:
    """Load `ckpt` in torch and wrap it with peft: (one forward + backward + AdamW call returning
    its loss, info with "losses": every call's loss, appended as it runs)."""
    import peft
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import Qwen3_5ForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(bench.threads)
    torch.manual_seed(bench.seed)
    t0 = time.perf_counter()
    model = Qwen3_5ForCausalLM.from_pretrained(
        ckpt, dtype=getattr(torch, bench.dtype), attn_implementation="sdpa"
    )
    r = bench.lora_rank
    lcfg = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(ALL_LINEAR))
    model = peft.get_peft_model(model, lcfg)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR)
    x = torch.as_tensor(ids, dtype=torch.long)
    vocab = bench.model.vocab_size
    losses: list[float] = []
    info: dict[str, Any] = {
        "load_s": time.perf_counter() - t0,
        "losses": losses,
        "threads": torch.get_num_threads(),
        "lora_params": sum(p.numel() for p in trainable),
    }

    def call() -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), x[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # .item() waits for the step (CPU torch is synchronous anyway)
        return losses[-1]

    return call, info


def torch_figures(
    bench: BenchConfig, times: list[float], first_s: float, info: dict[str, Any]
) -> dict[str, Any]:
    """The torch report from the timed repeats."""
    return {
        "step_s": figure(times),
        "tokens_per_s": rate(bench.tokens, times),
        "first_call_s": first_s,
        "load_s": info["load_s"],
        "loss_first": info["losses"][0],
        "loss_last": info["losses"][-1],
        "attn_implementation": "sdpa",
        "threads": info["threads"],
        "lora_params": info["lora_params"],
    }


def torch_train_step(bench: BenchConfig, ckpt: str | Path, ids: np.ndarray) -> dict[str, Any]:
    """Load `ckpt` in torch, wrap it with peft, time forward + backward + AdamW alone."""
    call, info = torch_step_runner(bench, ckpt, ids)
    times, first_s = timed(call, warmup=bench.warmup, repeats=bench.repeats)
    return torch_figures(bench, times, first_s, info)
