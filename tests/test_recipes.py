"""The real-model recipes (configs/sft/qwen3_5_*.yaml, configs/grpo/pi-*.yaml): they parse and
validate, each machine variant is the `jaxpi plan` config (configs/plan/) that sizes it, and
that plan fits (analytic in the default run, compiled in the slow one). Also the install extras'
JAX pins and the README's promises (length, paths, the 27B recipe's configs)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpi.config import FULL, QWEN3_5_9B, QWEN3_5_27B, QwenConfig, preset
from jaxpi.configfile import load_config
from jaxpi.plan.compiled import _build
from jaxpi.plan.config import PlanConfig
from jaxpi.rl.config import GRPOConfig
from jaxpi.sft.config import SFTConfig
from jaxpi.testing.xla import child_env

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


@dataclasses.dataclass(frozen=True)
class Variant:
    recipe: str  # configs/<group>/NAME.yaml
    plan: str  # configs/plan/NAME.yaml
    overrides: tuple[str, ...] = ()  # what the recipe's header says to add for this machine


VARIANTS = (
    Variant("sft/qwen3_5_27b.yaml", "sft-27b-8xh200"),
    Variant(
        "sft/qwen3_5_27b.yaml",
        "sft-27b-v5p-8",
        ("sharding.mesh=fsdp=4", "data.batch_size=4", "train.grad_accum=4"),
    ),
    Variant("grpo/pi-27b.yaml", "grpo-27b-1xh200"),
    Variant("grpo/pi-27b.yaml", "grpo-27b-v5p", ("collect.max_context=8192", "collect.max_tokens=6144")),
    Variant("sft/qwen3_5_9b.yaml", "sft-9b-8xh200"),
    Variant(
        "sft/qwen3_5_9b.yaml",
        "sft-9b-v5p-8",
        ("sharding.mesh=fsdp=4", "data.batch_size=4", "train.grad_accum=4"),
    ),
    Variant("grpo/pi-9b.yaml", "grpo-9b-1xh200"),
    Variant("grpo/pi-9b.yaml", "grpo-9b-v5p"),
)
IDS = [f"{v.recipe}@{v.plan}" for v in VARIANTS]
USABLE = 0.95  # the share of a device's memory JAX may take (XLA_PYTHON_CLIENT_MEM_FRACTION)
MODEL_OF = {"qwen3_5_27b": "Qwen3.5-27B", "qwen3_5_9b": "Qwen3.5-9B"}


def recipe(v: Variant) -> SFTConfig | GRPOConfig:
    cls = SFTConfig if v.recipe.startswith("sft/") else GRPOConfig
    return load_config(cls, CONFIGS / v.recipe, v.overrides)


def plan_config(v: Variant) -> PlanConfig:
    return load_config(PlanConfig, CONFIGS / "plan" / f"{v.plan}.yaml")


def header_overrides(path: Path) -> str:
    """The recipe's leading comment block (where it names each machine's overrides)."""
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, x in enumerate(lines) if not x.startswith("#"))])


@pytest.mark.parametrize("v", VARIANTS, ids=IDS)
def test_recipe_is_the_plan_it_names(v):
    cfg, plan = recipe(v), plan_config(v)
    head = header_overrides(CONFIGS / v.recipe)
    assert f"jaxpi plan --config {v.plan}" in head
    assert all(o in head for o in v.overrides), v.overrides
    # A real checkpoint of the plan's model, bf16 base, LoRA on every linear layer.
    assert MODEL_OF[plan.model] in cfg.model.base
    assert cfg.model.dtype == plan.dtype == "bfloat16"
    assert cfg.model.remat == plan.remat and cfg.model.loss_chunk == plan.loss_chunk
    assert (cfg.model.attn_impl, cfg.model.gdn_impl) == (plan.attn_impl, plan.gdn_impl)
    assert cfg.lora.rank == plan.lora_rank and cfg.lora.alpha == 2 * cfg.lora.rank
    assert set(cfg.lora.targets) == set(SFTConfig().lora.targets)  # the default: all linear layers
    assert cfg.lora.layers is None and cfg.lora.pattern is None
    if isinstance(cfg, SFTConfig):
        assert cfg.sharding.mesh == plan.mesh and (cfg.sharding.strategy or "fsdp") == plan.strategies[0]
        assert cfg.data.seq_len == plan.seq_len
        assert cfg.data.batch_size == plan.batch_per_device * plan.devices
        assert cfg.data.gate.require_verified
    else:
        # The GRPO trainer runs on one device, one row per microbatch.
        assert plan.mesh == "fsdp=1"
        assert cfg.collect.max_context == plan.seq_len
        assert cfg.rows // cfg.train.grad_accum == plan.batch_per_device == 1
        assert cfg.collect.max_tokens < cfg.collect.max_context
        assert cfg.env.name == "pi" and (ROOT / cfg.env.tasks_dir).is_dir()
        assert cfg.reward.kind == "effort_ordered" and cfg.reward.levels == ("low", "medium", "xhigh")
        assert cfg.collect.engine == "jax"  # env.name=pi samples from the trainer's own engine


@pytest.mark.parametrize("path", ["sft/tiny.yaml", "sft/toy.yaml", "grpo/tiny.yaml", "grpo/vllm-tiny.yaml"])
def test_toy_presets_are_not_recipes(path):
    # The recipes above are what a user of a real model copies; these stay toy-sized.
    text = (CONFIGS / path).read_text()
    assert "Qwen3.5-27B" not in text and "Qwen3.5-9B" not in text


def engine_cache_bytes(cfg: GRPOConfig, model_cfg: QwenConfig) -> int:
    """The rollout engine's decode cache (KV + DeltaNet state) at the recipe's batch and length."""
    model = nnx.eval_shape(lambda: _build(model_cfg, jnp.bfloat16, None))
    batch = cfg.collect.engine_batch or cfg.rows
    cache = jax.eval_shape(lambda: model.init_cache(batch, cfg.collect.max_context))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))


@pytest.mark.parametrize("v", VARIANTS, ids=IDS)
def test_recipe_fits_its_machine_by_the_analytic_plan(v):
    # `jaxpi plan --no-compile` in this process (every mesh here has at most 8 devices): abstract
    # shapes only, ~2 s each. The compiled plans are the slow test below.
    from jaxpi.plan import PlanRequest, plan

    cfg, pc = recipe(v), plan_config(v)
    assert pc.device_memory is not None
    res = plan(PlanRequest(**{**pc.request_fields(pc.strategies[0]), "compile": False}), progress=False)
    assert res.compiled is None and res.collectives is None and res.compile_seconds == 0.0
    assert res.peak_bytes == res.analytic["argument"] + res.analytic["temp"]
    need = res.peak_bytes
    if isinstance(cfg, GRPOConfig):  # the engine's cache lives beside the update on the device
        need += engine_cache_bytes(cfg, preset(pc.model))
    # JAX is started with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (the recipes say so): 95% is usable.
    assert res.fits and need <= USABLE * pc.device_memory, (need / 2**30, pc.device_memory / 2**30)


def run_plan(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = child_env()
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "jaxpi.cli", "plan", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


def test_plan_cli_without_compile_on_the_27b_recipe():
    proc = run_plan("--config", "sft-27b-8xh200", "--no-compile", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["compiled"] is None and r["collectives"] is None and r["fits"] is True
    assert r["devices"] == 8 and r["global_batch"] == 8 and r["request"]["compile"] is False


def test_plan_table_marks_analytic_figures():
    from jaxpi.plan import PlanRequest, format_table, plan

    res = plan(
        PlanRequest(model="tiny", mesh="fsdp=2", seq_len=16, lora_rank=4, compile=False), progress=False
    )
    table = format_table([res])
    assert "(analytic)" in table and "--no-compile" in table and "| " in table


@pytest.mark.slow
@pytest.mark.parametrize("v", VARIANTS, ids=IDS)
def test_recipe_fits_its_machine_compiled(v):
    # ~2-3 min each on 2 cores: the XLA:CPU compile of the real step for the recipe's mesh.
    proc = run_plan("--config", v.plan, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["fits"] is True and r["compiled"]["argument"] == r["analytic"]["argument"]
    cfg = recipe(v)
    if isinstance(cfg, GRPOConfig):
        pc = plan_config(v)
        assert r["peak_bytes"] + engine_cache_bytes(cfg, preset(pc.model)) <= USABLE * pc.device_memory


# ---- the Qwen3.5-9B preset --------------------------------------------------------------------

TEXT_PARAMS_9B = 8_953_803_264  # the 8.95B text parameters of the public checkpoint's tensors


def test_9b_preset_shape():
    c = QWEN3_5_9B
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        32,
        4096,
        12288,
        248320,
    )
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 4, 256)
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (16, 32)
    assert (c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim) == (128, 128, 4)
    assert c.rotary_dim == 64 and c.rope_theta == 1e7 and not c.tie_word_embeddings
    assert [i for i, t in enumerate(c.layer_types) if t == FULL] == list(range(3, 32, 4))
    assert preset("qwen3_5_9b") is c
    # The HF round trip keeps every field (`to_hf` writes the rope fields inside rope_parameters).
    again = QwenConfig.from_hf(c.to_hf())
    assert dataclasses.replace(again, hf_extra=c.hf_extra) == c


def lora_params(model_cfg: QwenConfig, rank: int) -> tuple[int, int]:
    from jaxpi.lora import LoRAParam

    model = nnx.eval_shape(lambda: _build(model_cfg, jnp.bfloat16, rank))
    count = lambda kind: sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, kind)))  # noqa: E731
    return count(LoRAParam), count(nnx.Param)


@pytest.mark.parametrize(("model_cfg", "base"), [(QWEN3_5_27B, 26_895_998_464), (QWEN3_5_9B, TEXT_PARAMS_9B)])
def test_recipe_rank_keeps_the_adapter_under_one_percent(model_cfg, base):
    # The seed's adapter "touches under 1% of the model's parameters": rank 32 does, 64 does not.
    adapter, params = lora_params(model_cfg, 32)
    assert params == base and adapter / base < 0.01
    assert lora_params(model_cfg, 64)[0] / base > 0.01


# ---- install extras ---------------------------------------------------------------------------


def test_accelerator_extras_pin_the_base_jax():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = dict(
        re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", d).groups() for d in project["dependencies"] if "==" in d
    )
    jax_version = pins["jax"]
    assert pins["jaxlib"] == jax_version
    extras = project["optional-dependencies"]
    assert extras["cuda"] == [f"jax[cuda12]=={jax_version}"]
    assert extras["tpu"] == [f"jax[tpu]=={jax_version}"]
    assert jax.__version__ == jax_version  # the environment the tests run in is the pinned one


# ---- the README -------------------------------------------------------------------------------

README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.splitlines()
    assert len(lines) <= 200, len(lines)
    first_block = README.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block


def test_readme_paths_exist():
    paths = set(
        re.findall(r"(?<![\w/.-])((?:configs|docs|tasks|tools|jaxpi|tests|sharding)/[\w./<>*-]*\w)", README)
    )
    assert len(paths) > 15
    missing = [p for p in sorted(paths) if "<" not in p and "*" not in p and not (ROOT / p).exists()]
    assert not missing, missing
    # Links to a section of a doc name a heading that exists there.
    for doc, anchor in re.findall(r"\((docs/[\w.-]+\.md)#([\w-]+)\)", README):
        heads = [_anchor(h) for h in re.findall(r"^#+ (.+)$", (ROOT / doc).read_text(), re.M)]
        assert anchor in heads, (doc, anchor)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def recipe_section() -> str:
    start = README.index("## The 27B recipe")
    return README[start : README.index("\n## ", start + 1)]


def test_readme_27b_recipe_uses_the_real_model_configs():
    section = recipe_section()
    configs = re.findall(r"--config (\S+)", section)
    assert "configs/sft/qwen3_5_27b.yaml" in configs and "configs/grpo/pi-27b.yaml" in configs
    assert not re.search(r"tiny|toy", " ".join(configs)), configs
    assert "tiny" not in section.lower() and "toy" not in section.lower()
    for c in configs:
        assert (ROOT / c).exists() or (CONFIGS / "plan" / f"{c}.yaml").exists(), c


def test_docs_point_at_readme_sections_that_exist():
    heads = {_anchor(h) for h in re.findall(r"^#+ (.+)$", README, re.M)}
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for anchor in re.findall(r"README\.md#([\w-]+)", doc.read_text()):
            assert anchor in heads, (doc.name, anchor)
    assert "install" in " ".join(re.findall(r"README\.md#([\w-]+)", (ROOT / "docs" / "vllm.md").read_text()))
