"""Light commands start without jax: their modules, and the packages above them, import no jax,
flax, torch or transformers (about 1.7 s of start-up each on 2 cores). Package `__init__`s
re-export lazily (PEP 562), so `from jaxpi.serve import ServeConfig` stays cheap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("jax", "flax", "torch", "transformers")

# What `jaxpi tasks`, `data`, `pi`, `serve`, `gateway`, `eval` and `vllm` import to parse their
# flags, and the lazy package facades.
LIGHT = (
    "jaxpi",
    "jaxpi.train",
    "jaxpi.rollout",
    "jaxpi.serve",
    "jaxpi.gateway",
    "jaxpi.serve.config",
    "jaxpi.tasks.cli",
    "jaxpi.data.cli",
    "jaxpi.runner.cli",
    "jaxpi.serve.cli",
    "jaxpi.gateway.cli",
    "jaxpi.eval.cli",
    "jaxpi.vllm.cli",
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
print(json.dumps(first))
"""


def test_light_modules_import_no_jax():
    code = PROBE.format(heavy=HEAVY, modules=LIGHT)
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
