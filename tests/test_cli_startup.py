"""Light commands start without jax: `jaxpi --help`, the light commands' --help and their modules
import no jax, flax, torch or transformers (about 1.7 s of start-up each on 2 cores). The front
door imports only the command that runs; package `__init__`s re-export lazily (PEP 562), so
`from jaxpi.serve import ServeConfig` stays cheap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("jax", "flax", "torch", "transformers")

# The front door and the modules of the commands that parse their flags without jax, and the
# lazy package facades.
LIGHT = (
    "jaxpi",
    "jaxpi.train",
    "jaxpi.rollout",
    "jaxpi.serve",
    "jaxpi.gateway",
    "jaxpi.plan",
    "jaxpi.serve.config",
    "jaxpi.cli",
    "jaxpi.cli.tasks",
    "jaxpi.cli.data",
    "jaxpi.cli.pi",
    "jaxpi.cli.serve",
    "jaxpi.cli.gateway",
    "jaxpi.cli.eval",
    "jaxpi.cli.vllm",
    "jaxpi.cli.plan",
    "jaxpi.cli.grpo",
    "jaxpi.cli.study",
)
# `jaxpi --help` and these commands' --help: only the command's own module is imported.
HELP = (
    [],
    ["tasks", "list"],
    ["data", "check"],
    ["pi", "run"],
    ["serve"],
    ["gateway"],
    ["eval"],
    ["select"],
    ["vllm", "serve"],
    ["plan"],
)

# Records, for the first import of each heavy package, the project lines that led to it.
PROBE = """
import importlib.abc, json, sys, traceback
HEAVY, first = {heavy!r}, {{}}
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in HEAVY and name not in first:
            first[name] = [f"{{f.filename}}:{{f.lineno}}" for f in traceback.extract_stack()[:-1]
                           if "/jaxpi/" in f.filename]
sys.meta_path.insert(0, Spy())
for m in {modules!r}:
    __import__(m)
import contextlib, io
from jaxpi.cli import main
for argv in {helps!r}:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main([*argv, "--help"])
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
print(json.dumps(first))
"""


def test_help_and_light_modules_import_no_jax():
    code = PROBE.format(heavy=HEAVY, modules=LIGHT, helps=HELP)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first = json.loads(out.stdout)
    assert not first, "light modules import heavy packages (first importing lines):\n" + "\n".join(
        f"  {name}: {' <- '.join(reversed(lines))}" for name, lines in first.items()
    )


def test_lazy_facades_still_export_their_names():
    import jaxpi
    import jaxpi.gateway
    import jaxpi.rollout
    import jaxpi.serve
    import jaxpi.train

    for pkg in (jaxpi, jaxpi.serve, jaxpi.rollout, jaxpi.train, jaxpi.gateway):
        missing = [n for n in pkg.__all__ if getattr(pkg, n, None) is None]
        assert not missing, f"{pkg.__name__}: {missing}"
        assert set(pkg.__all__) <= set(dir(pkg))
    import jaxpi.config
    from jaxpi import TINY

    assert TINY is jaxpi.config.TINY
    from jaxpi import atomic  # a submodule, not a re-export: imported as before

    assert atomic.__name__ == "jaxpi.atomic"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        jaxpi.serve.nope  # noqa: B018
