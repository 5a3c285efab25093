#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
python3 - <<'EOF'
src = open("search.py").read()
src = src.replace("while lo < hi:", "while lo <= hi:").replace("lo = mid\n", "lo = mid + 1\n")
open("search.py", "w").write(src)
EOF
