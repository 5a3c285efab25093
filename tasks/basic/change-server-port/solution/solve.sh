#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
python3 - <<'EOF'
import configparser
c = configparser.ConfigParser()
c.read("settings.ini")
c["server"]["port"] = "9090"
with open("settings.ini", "w") as f:
    c.write(f)
EOF
