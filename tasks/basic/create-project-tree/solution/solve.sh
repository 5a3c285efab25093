#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
mkdir -p project/src project/tests project/docs
: > project/src/__init__.py
: > project/tests/__init__.py
echo '# project' > project/README.md
echo 'print("hello")' > project/src/main.py
