"""The tiny demo tokenizer: byte-level BPE with 512 ids and our Qwen3.5-style chat template.

Trained (`tokenizers`, deterministic) on the demo sessions' text (messages, tool arguments and
results), Pi's tool schemas and the template itself, with Qwen's special tokens first (ids 0..8), and saved as a transformers tokenizer directory: `tokenizer.json` plus a
`tokenizer_config.json` carrying the chat template (`jaxpi/assets/templates/qwen3_5_tiny.jinja`),
eos `<|im_end|>` and pad `<|endoftext|>`. Every id is below the tiny model's vocabulary of 512.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxpi.data.tools import pi_tools

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
VOCAB_SIZE = 512  # the tiny model's vocabulary: every id must stay below it
ASSETS = Path(__file__).resolve().parent.parent / "assets"
TEMPLATE_PATH = ASSETS / "templates" / "qwen3_5_tiny.jinja"


def _corpus(files: dict[str, str]) -> list[str]:
    """Every string a rendered demo conversation can contain: message texts, tool JSON, template text."""
    texts: list[str] = [TEMPLATE_PATH.read_text(encoding="utf-8"), json.dumps(pi_tools())]

    def walk(x: Any) -> None:
        if isinstance(x, str):
            texts.append(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                texts.append(k)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for name, text in sorted(files.items()):
        if name.endswith(".jsonl"):
            for line in text.splitlines():
                try:
                    walk(json.loads(line))
                except json.JSONDecodeError:
                    texts.append(line)
    return texts


def train_tokenizer(files: dict[str, str]) -> Any:
    """A byte-level BPE (`tokenizers`) with VOCAB_SIZE ids in all, specials first (ids 0..8)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(files), trainer=trainer)
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} ids, more than {VOCAB_SIZE}")
    return tok


def tokenizer_files(files: dict[str, str]) -> dict[str, str]:
    """The transformers tokenizer directory as file name -> text (tokenizer.json + config)."""
    tok = train_tokenizer(files)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        "clean_up_tokenization_spaces": False,
        "chat_template": TEMPLATE_PATH.read_text(encoding="utf-8"),
    }
    return {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
    }
