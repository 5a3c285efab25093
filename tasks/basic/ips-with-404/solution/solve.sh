#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
awk '$9 == 404 {print $1}' access.log | LC_ALL=C sort -u > ips.txt
