import csv, json, sys
users = json.load(open("/tests/users.json"))
want = [[str(u["id"]), u["name"], u["email"]] for u in users if u["active"]]
try:
    rows = list(csv.reader(open("active_users.csv", newline="")))
except FileNotFoundError:
    sys.exit("FAIL: active_users.csv is missing")
if not rows or rows[0] != ["id", "name", "email"]:
    sys.exit(f"FAIL: header is {rows[:1]}")
if rows[1:] != want:
    sys.exit(f"FAIL: {len(rows) - 1} data rows, expected {len(want)} (or different content)")
print("ok")
