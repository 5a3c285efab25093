#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
find src -name '*.py' -exec sed -i 's/\t/    /g' {} +
