#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
awk '!seen[$0]++' emails.txt > unique.txt
