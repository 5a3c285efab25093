#!/bin/bash
# Oracle: a reference solution, run in a fresh workspace.
set -euo pipefail
python3 - <<'EOF'
import csv, json
t = {}
for r in csv.DictReader(open("orders.csv")):
    t[r["customer"]] = t.get(r["customer"], 0) + int(r["qty"]) * float(r["unit_price"])
json.dump({k: round(v, 2) for k, v in t.items()}, open("totals.json", "w"), indent=2)
EOF
