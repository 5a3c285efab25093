"""Every command's config: flags, `--config FILE_OR_NAME` and `key.sub=value` through one system
(jaxpi.cli.config_args over jaxpi.configfile). Parses arguments and builds configs only: no server
starts, nothing compiles."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st

from jaxpi.cli import bench, build_parser, eval, gateway, main, pi, plan, serve, vllm
from jaxpi.cli.config_args import ConfigSpec, build_config
from jaxpi.configfile import (
    ConfigError,
    field_names,
    load_config,
    required_keys,
)
from jaxpi.configfile.help import describe, field_comments, help_section, show_value
from jaxpi.plan.presets import PRESET_DIR, ShardingPreset, load_preset


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    for name in ("a", "b"):
        (tmp_path_factory.getbasetemp() / "vllm-model" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path_factory.getbasetemp() / "vllm-model" / name / "config.json").write_text(
            "{}"
        )  # ServerConfig checks it
    return tmp_path_factory.getbasetemp() / "vllm-model" / "a"


@dataclasses.dataclass(frozen=True)
class Case:
    """A command: its argv prefix, its spec, the positionals it needs and the keys it requires."""

    argv: tuple[str, ...]
    spec: ConfigSpec
    positionals: tuple[str, ...] = ()
    required: dict[str, Any] = dataclasses.field(default_factory=dict)  # set in the file or as key=value
    samples: dict[str, Any] = dataclasses.field(default_factory=dict)  # this command's own valid values
    # keys valid only beside others: key -> the values set with it
    companions: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return " ".join(self.argv)


def cases(model_dir: Path) -> list[Case]:
    out = [
        Case(("serve",), serve.SPEC, required={"model": "m"}),
        Case(("gateway",), gateway.SPEC, required={"upstream": "http://127.0.0.1:1"}),
        Case(("eval",), eval.EVAL, required={"tasks": "t", "model": "m"}),
        Case(("select",), eval.SELECT, positionals=("a", "b"), required={"tasks": "t"}),
        # lora_rank given: base_quant's sample (nf4) needs LoRA
        Case(("plan",), plan.SPEC, required={"mesh": "fsdp=2", "lora_rank": 4}),
        *(
            Case(
                ("bench", name),
                bench.SPECS[name],
                # a running vLLM server: with vs vllm (bf16) and the checkpoint it serves
                companions={"vllm_url": {"vs": "vllm", "dtype": "bfloat16", "checkpoint": "/some/ckpt"}}
                if "vllm_url" in field_names(bench.SPECS[name].cls)
                else {},
                samples={"mode": "decode"} if name == "profile" else {},
            )
            for name in bench.SPECS
        ),
        Case(
            ("vllm", "serve"),
            vllm.serve_spec(),
            required={"model": str(model_dir)},
            samples={"model": str(model_dir.with_name("b"))},
        ),
        Case(("vllm", "setup"), vllm.SETUP),
        Case(("pi", "run"), pi.RUN, positionals=("T",), required={"endpoint": "http://127.0.0.1:1/v1"}),
        Case(("pi", "setup"), pi.SETUP, samples={"version": "0.73.1"}),
    ]
    assert {c.argv[0] for c in out} == {"serve", "gateway", "eval", "select", "plan", "bench", "vllm", "pi"}
    return out


CASE_NAMES = [
    "serve",
    "gateway",
    "eval",
    "select",
    "plan",
    *(f"bench {n}" for n in bench.SPECS),
    "vllm serve",
    "vllm setup",
    "pi run",
    "pi setup",
]


@pytest.fixture(params=CASE_NAMES)
def case(request, model_dir) -> Case:
    (c,) = [c for c in cases(model_dir) if c.name == request.param]
    return c


def build(case: Case, *argv: str, config: Path | None = None) -> Any:
    extra = ["--config", str(config)] if config else []
    args = build_parser(case.argv[0]).parse_args([*case.argv, *case.positionals, *extra, *argv])
    return build_config(args)


def required_overrides(case: Case, skip: str = "") -> list[str]:
    return [f"{k}={v}" for k, v in case.required.items() if k != skip]


# A valid value other than the default, per key (by type where the type says enough).
SAMPLES: dict[str, Any] = {
    "remat": "mlp",
    "base_quant": "nf4",
    "attn_impl": "pallas",
    "gdn_impl": "jax_assoc",
    "impl": "jax_split",
    "kernels": "pallas",
    "vs": "torch",
    "level": "high",
    "kind": "cpu",
    "upstream": "http://127.0.0.1:9",
    "endpoint": "http://127.0.0.1:9/v1",
    "mesh": "fsdp=4",
    "dcn": "fsdp=2",
    "strategy": "tp",
    "batches": "2,4",
    "compile_layers": "2,3",
    "levels": ("low", "high"),
    "compare": ("dp", "tp"),
    "tools": ("bash",),
    "ckpts": ("c1", "c2"),
    "extra_args": ("--x", "1"),
    "prefill_chunks": (8, 1),
    "device_memory": 1024,
    "peak_n": 64,
    "hidden": 128,
    "intermediate": 256,
    "vocab": 1024,
    "seq": 32,
    "batch": 2,
    "lora_rank": 8,
    "max_lora_rank": 32,
    "max_len": 4000,  # the decode benchmarks check that it holds the prompt and the new tokens
    "workers": (2, 3),
}


def sample(case: Case, key: str, default: Any, hint: Any) -> Any:
    if key in case.samples:
        return case.samples[key]
    if key == "dtype":
        return "float32" if default == "bfloat16" else "bfloat16"
    if case.argv[0] == "bench" and key == "preset":
        return "mid"
    if case.argv[0] == "plan" and key in ("preset", "model"):
        return {"preset": "gpu-8xh200", "model": "tiny"}[key]
    if case.argv == ("bench", "compile") and key == "layers":
        return "2,3"
    base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if key in SAMPLES and (isinstance(SAMPLES[key], tuple) == (typing.get_origin(hint) is tuple)):
        return SAMPLES[key]
    if base[0] is bool:
        return not default
    if base[0] is int:
        return 3 if default is None else default + 1
    if base[0] is float:
        return 0.5 if default is None else default + 0.5
    if base[0] is str:
        return "/some/path-1"
    raise AssertionError(f"no sample for {case.name}: {key} ({hint})")


def as_text(value: Any) -> str:
    """`value` as written after `key=`: YAML for lists and numbers, a string as is."""
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return show_value(value) if not isinstance(value, str) else value


def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def test_every_key_set_by_key_value_comes_back(case):
    cls = case.spec.cls
    for doc in describe(cls, case.spec.defaults):
        value = sample(case, doc.key, None if doc.required else doc.default, hints(cls)[doc.key])
        assert value != doc.default, (case.name, doc.key)
        with_it = [f"{k}={v}" for k, v in case.companions.get(doc.key, {}).items()]
        argv = [*required_overrides(case, skip=doc.key), *with_it, f"{doc.key}={as_text(value)}"]
        if doc.key == "endpoint" and case.argv == ("eval",):  # eval takes one of model and endpoint
            argv = ["tasks=t", f"endpoint={value}"]
        assert getattr(build(case, *argv), doc.key) == value, (case.name, doc.key)


def test_a_close_misspelling_gets_did_you_mean(case, tmp_path):
    for key in field_names(case.spec.cls):
        typo = key + key[-1]
        with pytest.raises(ConfigError, match=f"did you mean '{key}'"):
            build(case, *required_overrides(case), f"{typo}=1")
    # In a file too, named in the message.
    path = tmp_path / "c.yaml"
    key = field_names(case.spec.cls)[0]
    path.write_text(yaml.safe_dump({key + key[-1]: 1}))
    with pytest.raises(
        ConfigError, match=rf"c\.yaml: unknown config key '{key + key[-1]}' \(did you mean '{key}'"
    ):
        build(case, *required_overrides(case), config=path)


def test_a_wrong_typed_value_names_the_key(case):
    cls = case.spec.cls
    for doc in describe(cls, case.spec.defaults):
        hint = hints(cls)[doc.key]
        base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if base[0] not in (int, float, bool):
            continue
        wrong = "[a, b]" if typing.get_origin(hint) is tuple else "[1, 2]"
        with pytest.raises(ConfigError, match=re.escape(doc.key)):
            build(case, *required_overrides(case, skip=doc.key), f"{doc.key}={wrong}")


def test_default_then_file_then_flag_given_then_override(case, tmp_path):
    """A flag left out keeps the file's value; a flag given (even at its default) beats the
    file; key=value beats both; with no file and no flag, the command's default."""
    cls, path = case.spec.cls, tmp_path / "c.yaml"
    docs = {d.key: d for d in describe(cls, case.spec.defaults)}
    for f in case.spec.flags:
        if f.positional or (f.key == "endpoint" and case.argv == ("eval",)):  # eval: model or endpoint
            continue
        doc = docs[f.key]
        in_file = sample(case, f.key, None if doc.required else doc.default, hints(cls)[f.key])
        path.write_text(
            yaml.safe_dump({**case.required, **case.companions.get(f.key, {}), f.key: _yaml(in_file)})
        )
        assert getattr(build(case, config=path), f.key) == in_file, (case.name, f.flag)
        if hints(cls)[f.key] is bool:  # store_true: given means true, over the file's false
            path.write_text(yaml.safe_dump({**case.required, f.key: False}))
            assert getattr(build(case, f.flag, config=path), f.key) is True, (case.name, f.flag)
            continue
        flag_value = case.required.get(f.key, None if doc.required else doc.default)
        if flag_value is not None:  # given at the default: still over the file
            given = [f.flag, _flag_text(f, flag_value)]
            assert getattr(build(case, *given, config=path), f.key) == flag_value, (case.name, f.flag)
            override = f"{f.key}={as_text(in_file)}"
            assert getattr(build(case, *given, override, config=path), f.key) == in_file, (case.name, f.flag)
        if f.key not in case.required and not doc.required:  # no file, no flag: the library's defaults
            given = [*required_overrides(case), *positional_overrides(case)]
            library = load_config(cls, None, given, defaults=case.spec.defaults)
            assert getattr(build(case, *required_overrides(case)), f.key) == getattr(library, f.key)


def positional_overrides(case: Case) -> list[str]:
    """The case's positionals as key=value (for a config built without the command line)."""
    (f,) = [f for f in case.spec.flags if f.positional] or [None]
    if f is None:
        return []
    return [f"{f.key}=[{', '.join(case.positionals)}]" if f.nargs else f"{f.key}={case.positionals[0]}"]


def _yaml(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _flag_text(f: Any, value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(value) if f.key == "extra_args" else ",".join(str(v) for v in value)
    return str(value)


def test_help_lists_every_key_with_its_type_and_default(case):
    parser = build_parser(case.argv[0])
    sub = parser._subparsers._group_actions[0].choices[case.argv[0]]
    for name in case.argv[1:]:
        sub = sub._subparsers._group_actions[0].choices[name]
    text = sub.format_help()
    assert "config keys (--config FILE, then the flags given, then key.sub=value" in text
    flags = {f.key: f.flag for f in case.spec.flags}
    for doc in describe(case.spec.cls, case.spec.defaults):
        shown = "(required)" if doc.required else f"= {show_value(doc.default)}"
        line = f"  {doc.key}: {doc.type} {shown}" + (f"  [{flags[doc.key]}]" if doc.key in flags else "")
        assert line + "\n" in text, (case.name, line)
    assert set(field_names(case.spec.cls)) == {d.key for d in describe(case.spec.cls)}


def test_every_flag_sets_one_key_and_the_presets_load(case):
    keys = [f.key for f in case.spec.flags]
    assert len(keys) == len(set(keys)) and set(keys) <= set(field_names(case.spec.cls)), case.name
    presets = sorted(case.spec.preset_dir.glob("*.yaml"))
    assert presets, f"no preset in {case.spec.preset_dir}"
    plain = build(case, *required_overrides(case))
    for path in presets:
        cfg = build(case, *required_overrides(case), "--config", path.stem)
        if path.stem == "default":  # the defaults, written out
            assert cfg == plain, (case.name, path)


def test_required_keys_are_asked_for_by_flag(case):
    for key in required_keys(case.spec.cls):
        if key in {f.key for f in case.spec.flags if f.positional}:
            continue
        flag = {f.key: f.flag for f in case.spec.flags}[key]
        with pytest.raises(ConfigError, match=f"{key} is required: give {flag} or {key}="):
            build(case, *required_overrides(case, skip=key))


# ---- through `main`: exit statuses and messages ---------------------------------------------------
def test_bad_config_input_exits_2_naming_the_command(capsys, tmp_path):
    assert main(["serve", "--model", "m", "port=abc"]) == 2
    assert "jaxpi serve: error: port: expected an integer, got 'abc'" in capsys.readouterr().err
    assert main(["plan", "--config", "nope"]) == 2
    err = capsys.readouterr().err
    assert "jaxpi plan: error: no config 'nope' in" in err and "default" in err
    assert main(["gateway", "--upstream", "http://x:1", "timeout=5"]) == 2
    assert "did you mean 'timeout_s'" in capsys.readouterr().err
    assert main(["bench", "decode", "repeats=0"]) == 2
    assert "jaxpi bench: error: invalid bench config: repeats must be >= 1" in capsys.readouterr().err
    assert main(["pi", "run", "T", "level=max"]) == 2  # before the task is read
    assert "endpoint is required: give --endpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own check of a flag's type stays
        main(["serve", "--model", "m", "--port", "abc"])
    assert e.value.code == 2 and "argument --port: invalid int value" in capsys.readouterr().err


def test_flags_and_overrides_mix_in_any_order():
    args = build_parser("pi").parse_args(
        ["pi", "run", "T", "level=high", "--endpoint", "http://h:1/v1", "out=o"]
    )
    cfg = build_config(args)
    assert (cfg.task, cfg.level, cfg.endpoint, cfg.out) == ("T", "high", "http://h:1/v1", "o")
    args = build_parser("select").parse_args(["select", "a", "--tasks", "t", "attempts=3", "b"])
    cfg = build_config(args)
    assert cfg.ckpts == ("a", "b") and cfg.attempts == 3  # key=value among the checkpoints


def test_plan_devices_come_from_the_file_or_the_preset(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("mesh: data=2,fsdp=3\n")
    cfg = build_config(build_parser("plan").parse_args(["plan", "--config", str(path)]))
    assert cfg.devices == 6
    cfg = build_config(build_parser("plan").parse_args(["plan", "--config", "27b-v5p-64"]))
    assert (cfg.mesh, cfg.devices, cfg.lora_rank, cfg.device_memory) == ("fsdp=32", 32, 64, 95 * 2**30)
    cfg = build_config(
        build_parser("plan").parse_args(["plan", "--preset", "gpu-8xh200", "--mesh", "fsdp=4"])
    )
    assert (cfg.mesh, cfg.strategy, cfg.device_memory) == ("fsdp=4", "fsdp", 141 * 2**30)


# ---- sharding presets -----------------------------------------------------------------------------
def test_sharding_presets_are_configs():
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        p = load_preset(path.stem)
        assert isinstance(p, ShardingPreset) and p.name == path.stem and p.devices
    assert load_preset(str(PRESET_DIR / "tpu-v5p-64.yaml")).mesh == "fsdp=32"
    with pytest.raises(FileNotFoundError, match=r"no sharding preset 'tpu-v9'.*known: gpu-2x8xh200"):
        load_preset("tpu-v9")


def test_a_sharding_preset_with_an_unknown_key_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("mesh: fsdp=8\ndevics: 8\n")
    with pytest.raises(
        ConfigError, match=r"mine\.yaml: unknown config key 'devics' \(did you mean 'devices'"
    ):
        load_preset(str(path))
    path.write_text("mesh: fsdp=8\ndevices: 4\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml: devices 4 is not the mesh's 8"):
        load_preset(str(path))


# ---- the generated help --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Section:
    # two lines of comment
    # above the field
    depth: int = 2
    name: str = "x"  # beside it
    bare: float = 1.0


@dataclasses.dataclass(frozen=True)
class Whole:
    run: str  # required, no default
    section: Section = dataclasses.field(default_factory=lambda: Section(depth=5))
    tags: tuple[str, ...] = ("a",)  # type: ignore[misc]


def test_help_section_reads_comments_above_and_beside_fields():
    assert field_comments(Section) == {"depth": "two lines of comment above the field", "name": "beside it"}
    text = help_section(Whole, defaults={"tags": ("b", "c")}, flags={"run": "--run"}, title="keys:")
    assert text.splitlines() == [
        "keys:",
        "  run: str (required)  [--run]",
        "      required, no default",
        "  section.depth: int = 5",  # the section's default instance
        "      two lines of comment above the field",
        '  section.name: str = "x"',
        "      beside it",
        "  section.bare: float = 1.0",
        '  tags: tuple[str, ...] = ["b", "c"]',  # the pragma is not a comment
    ]


@fixed_seed(24)
@settings(max_examples=60, deadline=None)
@given(
    depth=st.integers(-(2**40), 2**40),
    bare=st.floats(allow_nan=False, allow_infinity=False, width=32),
    name=st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), max_size=12),
    # words YAML reads as something else (yes, null, on) are not plain strings in a list
    tags=st.lists(
        st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(lambda t: yaml.safe_load(t) == t),
        max_size=4,
    ),
)
def test_key_value_round_trips_any_value_of_its_type(depth, bare, name, tags):
    overrides = [
        f"section.depth={depth}",
        f"section.bare={bare!r}",
        f"section.name={name}",
        f"tags=[{', '.join(tags)}]",
    ]
    cfg = load_config(Whole, None, ["run=r", *overrides])
    assert cfg.section == Section(depth=depth, name=name, bare=float(repr(bare)))
    assert cfg.tags == tuple(tags)


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_trainer_help_lists_every_key_and_a_bare_name_is_a_preset(command, capsys):
    """`jaxpi sft|grpo --help` ends with every config key and its default; `--config NAME` is
    configs/<command>/NAME.yaml (a missing name lists the known ones, exit 2)."""
    from jaxpi.cli import main
    from jaxpi.rl.config import GRPOConfig
    from jaxpi.sft.config import SFTConfig

    cls = SFTConfig if command == "sft" else GRPOConfig
    sub = build_parser(command)._subparsers._group_actions[0].choices[command]
    text = sub.format_help()
    for doc in describe(cls):
        assert f"  {doc.key}: {doc.type} = {show_value(doc.default)}\n" in text, (command, doc.key)
    assert main([command, "--config", "no-such-preset", "output.dir=/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "no config 'no-such-preset'" in err and "tiny" in err, err
    assert main([command, "--config", "tiny", "output.dirr=x"]) == 2
    assert "did you mean 'output.dir'" in capsys.readouterr().err
