"""The `jaxpi` command: parity, convert, tiny-checkpoint, demo (in-process and one real subprocess)."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpi.cli import build_parser, main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["tiny-checkpoint", str(out), "--kind", "conditional", "--layers", "4", "--seed", "5"]) == 0
    return out


def test_parity_json_passes_and_names_every_parameter(ckpt, capsys):
    assert main(["parity", "--hf-dir", str(ckpt), "--seq-len", "24", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["failing"] == []
    assert report["logits_rel"] <= 1e-4
    names = [g["name"] for g in report["grads"]]
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert len(names) == len(set(names)) > 50
    assert report["reference"] == "fp64"  # transformers in float64 is the arbiter
    ratios = [g["ratio"] for g in report["grads"]]
    assert ratios == sorted(ratios, reverse=True)  # worst first: jaxpi's error over torch's own
    assert max(g["rel_err"] for g in report["grads"]) <= 1e-3
    assert all(g["torch_rel_err"] is not None and g["passed"] for g in report["grads"])


def test_parity_with_an_injected_bug_exits_1(ckpt, capsys):
    code = main(["parity", "--hf-dir", str(ckpt), "--seq-len", "24", "--inject", "gated-norm-pre-gate"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "linear_attn.norm.weight" in out


def test_convert_check_and_export(ckpt, tmp_path, capsys):
    assert main(["convert", "--from", str(ckpt), "--check", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["layers"] == 4 and summary["carried_tensors"] > 0
    out = tmp_path / "bf16"
    assert main(["convert", "--from", str(ckpt), "--to", str(out), "--dtype", "bfloat16", "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert "model.safetensors" in written["files"] and "config.json" in written["files"]
    assert json.loads((out / "config.json").read_text())["text_config"]["dtype"] == "bfloat16"
    # A second export into the same non-empty directory is refused with a clear message.
    assert main(["convert", "--from", str(ckpt), "--to", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"jaxpi convert: error: {out} exists and is not empty; give --overwrite to replace it" in err
    # The flag the message names is one the commands that write directories take.
    flag = re.search(r"give (-[-\w]+)", err).group(1)
    for command in ("convert", "export"):
        (sub,) = [a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction)]
        assert flag in sub.choices[command]._option_string_actions, command
    assert main(["convert", "--from", str(ckpt), "--to", str(out), flag]) == 0


def test_convert_reports_a_bad_checkpoint_by_tensor_name(ckpt, tmp_path, capsys):
    import shutil

    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.language_model.layers.1.linear_attn.A_log"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", "--from", str(bad), "--check"]) == 2
    assert "model.language_model.layers.1.linear_attn.A_log" in capsys.readouterr().err


def test_console_script_help():
    for args in (["--help"], ["convert", "--help"], ["parity", "--help"], ["demo", "--help"]):
        out = subprocess.run(
            [sys.executable, "-m", "jaxpi.cli", *args], capture_output=True, text=True, check=True
        ).stdout
        assert "usage: jaxpi" in out
    assert (
        "--inject"
        in subprocess.run(
            [sys.executable, "-m", "jaxpi.cli", "parity", "--help"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, capsys):
    """What `make demo` runs: parity passes, the SFT loss falls, the export reloads in peft."""
    assert main(["demo", "--out", str(tmp_path / "demo"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["parity"]["passed"] is True
    losses = result["sft"]["losses"]
    assert len(losses) == result["sft"]["steps"] and losses[-1] < losses[0] - 0.5
    assert result["reload"]["rel_err_vs_peft"] <= 1e-4 < result["reload"]["adapter_effect"]
    deploy = result["deploy"]
    assert deploy["passed"] and deploy["gguf_bf16_vs_jaxpi_ppl"] < 0.01
    assert set(deploy["gguf"]) == {"BF16", "Q8_0", "Q4_K_M"} and deploy["fp8"]["quantized_tensors"] > 0


def test_the_command_table_is_what_the_parsers_register():
    """`jaxpi --help` is printed from jaxpi.cli.registry without importing the commands: it must
    read exactly as the parser with every command's module registered."""
    import argparse

    from jaxpi.cli import ALL, build_parser
    from jaxpi.cli.registry import COMMANDS

    full = build_parser(ALL)
    assert build_parser(None).format_help() == full.format_help()
    (sub,) = [a for a in full._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(sub.choices) == [c.name for c in COMMANDS]
    assert {a.dest: a.help for a in sub._choices_actions} == {c.name: c.help for c in COMMANDS}
    for c in COMMANDS:  # `jaxpi CMD` registers CMD's own arguments, the others as placeholders
        (one,) = [a for a in build_parser(c.name)._actions if isinstance(a, argparse._SubParsersAction)]
        own = {name for name, p in one.choices.items() if len(p._actions) > 1}
        assert c.name in own and own <= {d.name for d in COMMANDS if d.module == c.module}


def test_bad_input_exits_2_and_names_the_command(capsys):
    # A bad value is refused before anything is loaded or started, as every command does.
    assert main(["serve", "--model", "m", "--max-batch", "0"]) == 2
    assert "jaxpi serve: error: max_batch must be >= 1" in capsys.readouterr().err
    assert main(["gateway", "--upstream", "127.0.0.1:8000"]) == 2
    assert "jaxpi gateway: error: upstream must be an http" in capsys.readouterr().err


def test_config_commands_take_a_preset_then_flags_then_overrides(capsys):
    """serve, gateway, eval, select, plan, bench, vllm and pi: `--config FILE_OR_NAME` (a bare NAME
    is configs/<group>/NAME.yaml), the flags, trailing key.sub=value; --help ends with the keys."""
    for argv in (
        ["serve"],
        ["gateway"],
        ["eval"],
        ["select"],
        ["plan"],
        ["bench", "gdn"],
        ["bench", "serve"],
        ["vllm", "serve"],
        ["vllm", "setup"],
        ["pi", "run"],
        ["pi", "setup"],
    ):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and "--config FILE_OR_NAME" in out, argv
        assert "\nconfig keys (--config FILE, then the flags given, then key.sub=value" in out, argv
    # The file's value, a flag over it, an override over both; errors name the file and the key.
    assert main(["serve", "--config", "default", "--model", "m", "--max-batch", "0"]) == 2
    assert "serve/default.yaml: max_batch must be >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", "--model", "m", "--max-batch", "0", "max_batch=3", "max_len=1"]) == 2
    assert "jaxpi serve: error: max_len must be >= 2, got 1" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny", "--config", "default", "mesh=fsdp=2", "remat=al"]) == 2
    assert "remat 'al' is not one of" in capsys.readouterr().err


def test_tiny_checkpoint_carries_the_tiny_tokenizer_so_serve_loads_it(ckpt):
    """`jaxpi tiny-checkpoint OUT` then `jaxpi serve --model OUT`: the tokenizer with its chat
    template comes in the checkpoint, and serve's loader takes it from there."""
    from jaxpi.cli.serve import serve_config
    from jaxpi.data.render import load_tokenizer
    from jaxpi.serve.loading import load_served_model

    assert (ckpt / "tokenizer.json").is_file() and load_tokenizer(str(ckpt)).chat_template
    loaded = load_served_model(
        serve_config(build_parser("serve").parse_args(["serve", "--model", str(ckpt)]))
    )
    assert loaded.tokenizer_dir == ckpt and loaded.base_dir == ckpt


def test_serve_without_a_chat_template_names_the_tokenizer_flag(ckpt, tmp_path, capsys):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(ckpt / name, bare / name)
    assert main(["serve", "--model", str(bare)]) == 2
    err = capsys.readouterr().err
    assert f"jaxpi serve: error: tokenizer in {bare} has no chat_template; give --tokenizer DIR" in err
    assert main(["serve", "--model", str(bare), "--tokenizer", str(bare)]) == 2
    assert f"jaxpi serve: error: --tokenizer {bare}: tokenizer in {bare}" in capsys.readouterr().err


def test_tiny_checkpoint_is_written_atomically_and_keeps_what_is_there(tmp_path, capsys, monkeypatch):
    """OUT appears complete or not at all: a non-empty OUT is refused (exit 2, nothing touched)
    unless --overwrite; a write that fails leaves OUT as it was and no temporary beside it."""
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main(["tiny-checkpoint", str(out), "--layers", "2"]) == 2
    assert "give --overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]

    import jaxpi.hf_fixtures as fixtures

    def broken(tmp, *a, **k):
        (Path(tmp) / "config.json").write_text("{}")  # half a checkpoint, then a failure
        raise ValueError("the write failed half-way")

    monkeypatch.setattr(fixtures, "make_checkpoint", broken)
    assert main(["tiny-checkpoint", str(out), "--layers", "2", "--overwrite"]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    monkeypatch.undo()
    assert main(["tiny-checkpoint", str(out), "--layers", "2", "--overwrite"]) == 0
    assert (out / "config.json").is_file() and not (out / "mine.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_vllm_tiny_checkpoint_keeps_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    """A non-empty OUT without config.json is refused (exit 2) with its files untouched."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    assert main(["vllm", "tiny-checkpoint", str(out)]) == 2
    assert "give --overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
