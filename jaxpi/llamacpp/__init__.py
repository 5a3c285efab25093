"""llama.cpp, built once from a registry package into a cache, and run from jaxpi.

`setup` builds the quantizer, the importance-matrix and perplexity tools and the shared library
from the llama.cpp sources vendored in the `llama-cpp-python` sdist (PyPI), into
`~/.cache/jaxpi/llama.cpp-<version>`; `runtime` finds that build, runs its tools and evaluates
GGUF files through `llama-cpp-python`'s bindings to the same library.
"""
