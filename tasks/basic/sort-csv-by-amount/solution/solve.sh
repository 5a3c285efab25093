#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
{ head -n 1 sales.csv; tail -n +2 sales.csv | sort -t, -k3,3 -g -r; } > sorted.csv
