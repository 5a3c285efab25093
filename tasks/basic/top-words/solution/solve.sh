#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
tr -cs 'A-Za-z' '\n' < book.txt | tr 'A-Z' 'a-z' | grep -v '^$' | sort | uniq -c | sort -k1,1nr -k2 | head -n 3 | awk '{print $2, $1}' > answer.txt
