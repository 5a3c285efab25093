#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
python3 - <<'EOF'
import csv, json
users = json.load(open("users.json"))
with open("active_users.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["id", "name", "email"])
    for u in users:
        if u["active"]:
            w.writerow([u["id"], u["name"], u["email"]])
EOF
