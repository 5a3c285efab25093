#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
python3 - <<'EOF'
import re
s = open("config.json").read()
s = re.sub(r"//.*", "", s)
s = s.replace("'debug'", '"debug"')
s = re.sub(r",\s*([\]}])", r"\1", s)
open("config.json", "w").write(s)
EOF
