import csv, sys
src = list(csv.DictReader(open("/tests/sales.csv")))
want = sorted(src, key=lambda r: -float(r["amount"]))
try:
    lines = open("sorted.csv").read().splitlines()
except FileNotFoundError:
    sys.exit("FAIL: sorted.csv is missing")
if not lines or lines[0].strip() != "region,rep,amount":
    sys.exit("FAIL: the header line is wrong")
got = list(csv.DictReader(lines))
if [float(r["amount"]) for r in got] != [float(r["amount"]) for r in want]:
    sys.exit("FAIL: rows are not sorted by amount, largest first")
if sorted(map(lambda r: tuple(r.values()), got)) != sorted(map(lambda r: tuple(r.values()), src)):
    sys.exit("FAIL: the rows are not the original rows")
print("ok")
