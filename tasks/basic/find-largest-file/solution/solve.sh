#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
find data -type f -printf '%s %p\n' | sort -n | tail -n 1 | cut -d' ' -f2- > answer.txt
