"""Test setup: JAX on the CPU with 8 virtual devices (the sharding tests' meshes), quiet transformers."""

import os

from jaxpi.testing.xla import SUITE

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Must precede JAX's backend start-up; single-device tests simply use device 0. The LLVM level 0
# of jaxpi.testing.xla halves the suite's compile time; XLA_FLAGS in the environment wins.
os.environ.setdefault("XLA_FLAGS", SUITE)
# The `jaxpi` commands the tests run (in subprocesses and in-process) share one compilation cache
# per test run, made here in the controller and inherited by xdist's workers, so that repeated
# runs load what earlier ones compiled, as a user's do (test_sft.py and test_grpo_run.py keep
# their own, to check what a resume compiles). Per run, not ~/.cache: each `make test` starts
# cold like a fresh machine.
if "JAXPI_COMPILE_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="jaxpi-test-xla-")
    os.environ["JAXPI_COMPILE_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

try:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
except ImportError:  # pragma: no cover - the test extra installs it
    pass


# The heaviest files first (measured), so that `make test`'s workers (pytest-xdist, one file per
# worker at a time, `--no-loadscope-reorder` keeps this order) do not end on one long file alone.
# The other files keep their alphabetical order after these.
HEAVY_FIRST = (
    "test_grpo_run.py",
    "test_study.py",
    "test_sft.py",
    "test_pi_runner.py",
    "test_vllm.py",
    "test_packed_decode.py",
    "test_lora.py",
    "test_toy_sft.py",
    "test_sharding.py",
    "test_model_parity.py",
    "test_planner.py",
    "test_bench.py",
    "test_jax_engine.py",
    "test_export.py",
    "test_inject.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
