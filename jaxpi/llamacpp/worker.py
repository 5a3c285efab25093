"""`python -m jaxpi.llamacpp.worker REQUEST.npz RESULT.npz`: evaluate a GGUF file in llama.cpp in a
process of its own, so that an abort inside llama.cpp (a GGML_ASSERT ends the whole process)
becomes an error for the caller instead of the caller's death (`runtime.gguf_logits`,
`runtime.gguf_nll`).

Request (numpy .npz, no pickles): `model`, `lora` (or ""), `lora_scale`, `kv_f32`, `mode`
("logits" or "nll"), `tokens` (every sequence end to end) and `lengths`. Result: "logits":
`logits_<i>` `[T_i, vocab]` float32 per sequence; "nll": per sequence the summed negative
log-likelihood of tokens[1:] (float64) and its token count. A LlamaCppError exits 2 with its
message on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from jaxpi.llamacpp.runtime import GGUFModel, LlamaCppError, find, nll_per_token


def main(argv: list[str]) -> int:
    request, result = map(Path, argv)
    with np.load(request, allow_pickle=False) as req:
        model, lora, mode = str(req["model"]), str(req["lora"]) or None, str(req["mode"])
        scale, kv_f32 = float(req["lora_scale"]), bool(req["kv_f32"])
        tokens, lengths = req["tokens"], req["lengths"]
    seqs = np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []
    out: dict[str, np.ndarray] = {}
    try:
        with GGUFModel(
            find(), model, n_ctx=int(lengths.max()), lora=lora, lora_scale=scale, kv_f32=kv_f32
        ) as m:
            nll, count = [], []
            for i, ids in enumerate(seqs):
                logits = m.logits(ids.tolist())
                if mode == "logits":
                    out[f"logits_{i}"] = logits
                else:
                    per = nll_per_token(logits, ids.tolist())
                    nll.append(float(per.sum()))
                    count.append(len(per))
            if mode == "nll":
                out["nll"], out["count"] = np.asarray(nll, np.float64), np.asarray(count, np.int64)
    except (LlamaCppError, ValueError, FileNotFoundError) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    np.savez(result, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
