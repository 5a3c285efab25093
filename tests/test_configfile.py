"""YAML configs and `key.sub=value` overrides for frozen dataclasses (jaxpi.configfile)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st

from jaxpi.cli import main
from jaxpi.configfile import ConfigError, field_names, load_config, to_dict
from jaxpi.sft.config import SFTConfig

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float = 0.1
    names: tuple[str, ...] = ("a",)
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.rate < 0:
            raise ValueError(f"inner.rate must be >= 0, got {self.rate}")


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str = "x"
    steps: int = 1
    flag: bool = False
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: run\nsteps: 3\ninner:\n  rate: 1e-3\n  names: [p, q]\n")
    cfg = load_config(Outer, path)
    # YAML 1.1 reads `1e-3` as a string; the float field converts it.
    assert cfg == Outer(name="run", steps=3, inner=Inner(rate=1e-3, names=("p", "q")))
    cfg = load_config(
        Outer, path, ["inner.rate=0.5", "flag=true", "inner.limit=7", "name=007", "inner.names=u,v"]
    )
    assert cfg.inner == Inner(rate=0.5, names=("u", "v"), limit=7)
    assert cfg.flag is True and cfg.name == "007"  # str fields keep the text as written
    assert load_config(Outer, path, ["inner.limit=null"]).inner.limit is None
    assert load_config(Outer, None, ["steps=1_000"]).steps == 1000
    assert to_dict(cfg) == {
        "name": "007",
        "steps": 3,
        "flag": True,
        "inner": {"rate": 0.5, "names": ["u", "v"], "limit": 7},
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["steps=three"], "steps: expected an integer, got 'three'"),
        (["steps=1.5"], "steps: expected an integer, got 1.5"),
        (["flag=maybe"], "flag: expected true or false, got 'maybe'"),
        (["inner.rate=fast"], "inner.rate: expected a number, got 'fast'"),
        (["inner.rate=-1"], "inner.rate must be >= 0, got -1.0"),  # the dataclass's own check
        (
            ["inner.rtae=1"],
            r"unknown config key 'inner.rtae' \(did you mean 'inner.rate'\?\); valid keys: inner.rate, ",
        ),
        (
            ["nope=1"],
            "unknown config key 'nope'; valid keys: name, steps, flag, inner.rate, inner.names, inner.limit",
        ),
        (["inner=1"], "'inner' is a section; set one of its keys: inner.rate"),
        (["steps.sub=1"], "steps is a value, not a section"),
        (["steps"], "not of the form key.sub=value"),
    ],
)
def test_override_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Outer, None, overrides)


def test_unknown_yaml_key_lists_the_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  rate: 1\n  colour: red\n")
    with pytest.raises(
        ConfigError, match=r"c.yaml: unknown config key 'inner.colour'; valid keys: inner.rate, inner.names"
    ):
        load_config(Outer, path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(Outer, path)
    with pytest.raises(FileNotFoundError):
        load_config(Outer, tmp_path / "missing.yaml")


@fixed_seed(5)
@settings(max_examples=15, deadline=None)
@given(lines=st.integers(1, 8), bad=st.data())
def test_a_yaml_syntax_error_is_file_line_message(tmp_path_factory, lines, bad):
    """A file that is not YAML is named with the line at fault, as `FILE:LINE: problem`, one line."""
    k = bad.draw(st.integers(1, lines), label="bad line")
    rows = ["name: a"] * lines
    rows[k - 1] = "\tsteps: 1"  # a tab cannot start a YAML token
    path = tmp_path_factory.mktemp("yaml") / "c.yaml"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(Outer, path)
    assert str(e.value).startswith(f"{path}:{k}: found character '\\t' that cannot start any token")
    assert "\n" not in str(e.value)


def test_a_yaml_syntax_error_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: 3\n  eval_every: [1, 2\nmodel:\n  base: x\n")
    assert main(["sft", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"jaxpi sft: error: {path}:4: expected ',' or ']', but got ':' (column 6; while parsing a flow "
        "sequence started at line 3)\n"
    )
    with pytest.raises(ConfigError, match=r"override steps=\[1: the value is not YAML: expected ','"):
        load_config(Outer, None, ["steps=[1"])


def test_the_sft_docs_numbers_are_the_tiny_configs():
    """docs/sft.md describes configs/sft/tiny.yaml in numbers; they are read from the file here."""
    import re

    from jaxpi.sft.config import DEMO_SESSIONS

    doc = (ROOT / "docs" / "sft.md").read_text()
    cfg = load_config(SFTConfig, ROOT / "configs" / "sft" / "tiny.yaml")

    def number(pattern: str) -> tuple[int, ...]:
        m = re.search(pattern, doc)
        assert m, f"docs/sft.md no longer says {pattern!r}"
        return tuple(int(g) for g in m.groups())

    assert number(r"trains (\d+) steps") == (cfg.train.steps,)
    assert number(r"each step is (\d+) rows of (\d+) tokens") == (cfg.data.batch_size, cfg.data.seq_len)
    assert number(r"renders the (\d+) bundled demo sessions") == (len(list(Path(DEMO_SESSIONS).iterdir())),)
    more, to = number(r"train\.steps=(\d+) +# resumes, goes on to (\d+)")
    assert more == to > cfg.train.steps  # the resume example trains past the config's last step


def test_sft_configs_load_and_every_field_is_overridable():
    for path in sorted((ROOT / "configs" / "sft").glob("*.yaml")):
        cfg = load_config(SFTConfig, path)
        assert cfg.train.steps >= 1, path
    keys = field_names(SFTConfig)
    assert {
        "model.base",
        "data.gate.max_tokens",
        "lora.rank",
        "optim.lr",
        "train.eval_hook",
        "sharding.mesh",
    } <= set(keys)
    cfg = load_config(
        SFTConfig,
        ROOT / "configs" / "sft" / "tiny.yaml",
        [
            "lora.targets=q_proj,v_proj",
            "data.gate.allowed_efforts=[low,medium]",
            "optim.lr=1e-4",
            "train.steps=5",
        ],
    )
    assert cfg.lora.targets == ("q_proj", "v_proj") and cfg.data.gate.allowed_efforts == ("low", "medium")
    assert cfg.optim.lr == 1e-4 and cfg.train.steps == 5
    with pytest.raises(ConfigError, match="unknown LoRA targets"):
        load_config(SFTConfig, None, ["lora.targets=q_proj,nope"])
    with pytest.raises(ConfigError, match=r"train\.eval_hook must be 'module:function'"):
        load_config(SFTConfig, None, ["train.eval_hook=nothing"])
    with pytest.raises(ConfigError, match=r"sharding\.strategy needs sharding\.mesh"):
        load_config(SFTConfig, None, ["sharding.strategy=fsdp"])


@dataclasses.dataclass(frozen=True)
class _Train:
    async_: bool = False  # a keyword's field: spelled `async` in files and overrides
    steps: int = 1


@dataclasses.dataclass(frozen=True)
class _Run:
    train: _Train = dataclasses.field(default_factory=_Train)


def test_a_keyword_field_is_its_keyword_in_files_overrides_and_help(tmp_path):
    from jaxpi.configfile.help import describe

    assert field_names(_Run) == ["train.async", "train.steps"]
    assert load_config(_Run, overrides=["train.async=true"]).train.async_ is True
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  async: true\n  steps: 3\n")
    cfg = load_config(_Run, path)
    assert (cfg.train.async_, cfg.train.steps) == (True, 3)
    assert to_dict(cfg) == {"train": {"async": True, "steps": 3}}
    assert [d.key for d in describe(_Run)] == ["train.async", "train.steps"]
    # The field's own spelling is not a key: one name per setting.
    with pytest.raises(ConfigError, match=r"unknown config key 'train.async_' \(did you mean 'train.async'"):
        load_config(_Run, overrides=["train.async_=true"])
