#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
python3 - <<'EOF'
import re
src = open("stack.py").read()
src = src.replace("return self._items.pop(0)", "return self._items.pop()")
src = src.replace("return self._items[0]", "return self._items[-1]")
open("stack.py", "w").write(src)
EOF
