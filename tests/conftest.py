"""Test setup: JAX on the CPU, quiet transformers."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
except ImportError:  # pragma: no cover - the test extra installs it
    pass
