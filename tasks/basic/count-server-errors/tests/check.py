import re, sys
n = 0
for line in open("/tests/app.log"):
    parts = line.split()
    if parts[1] == "ERROR" and re.search(r"status=5\d\d\b", line):
        n += 1
try:
    got = open("answer.txt").read().strip()
except FileNotFoundError:
    sys.exit("FAIL: answer.txt is missing")
if got != str(n):
    sys.exit(f"FAIL: answer.txt says {got!r}")
print("ok")
