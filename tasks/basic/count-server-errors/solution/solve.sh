#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
grep -E '^[^ ]+ ERROR .*status=5[0-9][0-9]\b' app.log | wc -l | tr -d ' ' > answer.txt
