import csv, json, sys
want = {}
for r in csv.DictReader(open("/tests/orders.csv")):
    want[r["customer"]] = want.get(r["customer"], 0) + int(r["qty"]) * float(r["unit_price"])
try:
    got = json.load(open("totals.json"))
except FileNotFoundError:
    sys.exit("FAIL: totals.json is missing")
except ValueError as e:
    sys.exit(f"FAIL: totals.json is not JSON: {e}")
if not isinstance(got, dict) or set(got) != set(want):
    sys.exit(f"FAIL: customers {sorted(got) if isinstance(got, dict) else got}")
for k, v in want.items():
    if not isinstance(got[k], (int, float)) or abs(got[k] - v) > 0.006:
        sys.exit(f"FAIL: {k}: {got[k]!r}, expected {round(v, 2)}")
print("ok")
