"""`jaxpi gguf setup`: build llama.cpp once into a cache outside the checkout.

Source: the llama.cpp tree vendored in the `llama-cpp-python` sdist on PyPI (no binaries are
downloaded). `pip download` fetches the sdist; CMake builds, with `$ORIGIN` run paths so the
build can be moved:

- `llama-quantize`, `llama-imatrix`, `llama-perplexity` (llama.cpp's own tools);
- `libllama.so` and the `libggml*.so` it needs, which the `llama_cpp` Python package of the same
  sdist (copied beside them) loads through `LLAMA_CPP_LIB_PATH`.

The build directory is `$JAXPI_LLAMACPP_DIR`, else `~/.cache/jaxpi/llama.cpp-<version>`; every
clone and CI run on a machine reuses it. It is built in a hidden temporary directory beside its
place and renamed into it once complete (`jaxpi.atomic.atomic_dir`), with a stamp (JSON:
versions, flags) written last: a directory without a matching stamp is rebuilt. Concurrent
setups wait on a lock file rather than build twice.

`-O1` (not CMake's Release `-O3`): it compiles in about 60% of the time (measured on 2 cores: 2 min
45 s against 4 min 20 s) and the ggml kernels that do the work are written with intrinsics.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jaxpi.atomic import atomic_dir, write_text

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
STAMP_NAME = ".jaxpi-llamacpp-stamp.json"
TOOLS = ("llama-quantize", "llama-imatrix", "llama-perplexity")
OPT_FLAGS = "-O1"
_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    f"-DCMAKE_C_FLAGS_RELEASE={OPT_FLAGS}",
    f"-DCMAKE_CXX_FLAGS_RELEASE={OPT_FLAGS}",
    "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DGGML_OPENMP=OFF",
)


def default_dir() -> Path:
    """`$JAXPI_LLAMACPP_DIR`, else `~/.cache/jaxpi/llama.cpp-<llama-cpp-python version>`."""
    if os.environ.get("JAXPI_LLAMACPP_DIR"):
        return Path(os.environ["JAXPI_LLAMACPP_DIR"]).expanduser()
    return Path.home() / ".cache" / "jaxpi" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"


def stamp() -> dict[str, Any]:
    return {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "tools": list(TOOLS), "opt": OPT_FLAGS}


def is_ready(root: Path) -> bool:
    """True when `root` holds a finished build of this version (its stamp matches)."""
    try:
        found = json.loads((root / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(found, dict) or {k: found.get(k) for k in stamp()} != stamp():
        return False
    return all((root / "bin" / t).is_file() for t in TOOLS) and (root / "python" / "llama_cpp").is_dir()


@contextlib.contextmanager
def _lock(root: Path) -> Iterator[None]:
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: list[str], log: Callable[[str], None], cwd: Path | None = None) -> None:
    log(f"$ {' '.join(cmd)}")
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        hint = ""
        if "pip" in cmd[:3] and any(
            s in proc.stdout for s in ("Could not find", "NewConnectionError", "unreachable")
        ):
            hint = (
                "\n(the package index looks unreachable: building llama.cpp needs PyPI once, for the sdist)"
            )
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{tail}{hint}")


def _need(program: str) -> str:
    found = shutil.which(program)
    if found is None:
        raise RuntimeError(
            f"building llama.cpp needs {program!r} on PATH (Debian: apt-get install cmake g++; "
            f"or pip install cmake ninja)"
        )
    return found


def build(root: Path | None = None, *, force: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """Build (or reuse) llama.cpp at `root`; returns a summary. Raises RuntimeError on failure."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    root = Path(root) if root is not None else default_dir()
    t0 = time.monotonic()
    with _lock(root):
        if is_ready(root) and not force:
            log(f"llama.cpp ready at {root} (from llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION})")
            return {"dir": str(root), "built": False, **stamp(), "seconds": 0.0}
        cmake, gxx = _need("cmake"), _need("g++")
        ninja = shutil.which("ninja")
        with atomic_dir(root, overwrite=True) as tmp:
            # Sources and objects inside the hidden temporary: a killed build leaves nothing the
            # next one does not clean.
            work = tmp / ".work"
            work.mkdir()
            log(
                f"[1/3] llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist (the llama.cpp sources it vendors)"
            )
            _run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                 "--dest", str(work), f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
                log,
            )  # fmt: skip
            sdists = sorted(work.glob("llama_cpp_python-*.tar.gz"))
            if not sdists:
                raise RuntimeError(f"pip download left no llama_cpp_python sdist in {work}")
            with tarfile.open(sdists[0]) as tar:
                tar.extractall(work, filter="data")
            src = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
            vendor = src / "vendor" / "llama.cpp"
            if not (vendor / "CMakeLists.txt").is_file():
                raise RuntimeError(f"{sdists[0].name} vendors no llama.cpp tree (no {vendor}/CMakeLists.txt)")
            build_dir = work / "build"
            log(f"[2/3] building {', '.join(TOOLS)} and libllama ({OPT_FLAGS}; ~3 min on 2 cores)")
            gen = ["-G", "Ninja"] if ninja else []
            _run(
                [
                    cmake,
                    "-S",
                    str(vendor),
                    "-B",
                    str(build_dir),
                    *gen,
                    f"-DCMAKE_CXX_COMPILER={gxx}",
                    *_CMAKE_ARGS,
                ],
                log,
            )
            jobs = str(os.cpu_count() or 2)
            _run([cmake, "--build", str(build_dir), "--parallel", jobs, "--target", *TOOLS, "llama"], log)
            log("[3/3] installing into the cache")
            (tmp / "bin").mkdir()
            built = build_dir / "bin"
            for f in sorted(built.iterdir()):
                if f.name in TOOLS or ".so" in f.name:
                    shutil.copy2(f, tmp / "bin" / f.name, follow_symlinks=False)
            (tmp / "python").mkdir()
            shutil.copytree(src / "llama_cpp", tmp / "python" / "llama_cpp")
            shutil.copy2(src / "LICENSE.md", tmp / "LICENSE-llama-cpp-python.md")
            shutil.copy2(vendor / "LICENSE", tmp / "LICENSE-llama.cpp")
            probe = subprocess.run(
                [str(tmp / "bin" / "llama-quantize"), "--help"], capture_output=True, text=True
            )
            if "usage" not in (probe.stdout + probe.stderr).lower():
                raise RuntimeError(f"the built llama-quantize does not run:\n{probe.stdout}{probe.stderr}")
            shutil.rmtree(work)
            write_text(tmp / STAMP_NAME, json.dumps({**stamp(), "built_at": time.time()}, indent=2) + "\n")
    seconds = round(time.monotonic() - t0, 1)
    log(f"llama.cpp built at {root} in {seconds:.0f} s")
    return {"dir": str(root), "built": True, **stamp(), "seconds": seconds}
