"""Test setup: JAX on the CPU with 8 virtual devices (the sharding tests' meshes), quiet transformers."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Must precede JAX's backend start-up; single-device tests simply use device 0.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

try:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
except ImportError:  # pragma: no cover - the test extra installs it
    pass
