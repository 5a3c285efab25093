#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
sed -i 's/range(len(xs) - k)/range(len(xs) - k + 1)/' window.py
