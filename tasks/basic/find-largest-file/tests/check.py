import os, sys
best = max((os.path.getsize(os.path.join(r, f)), os.path.join(r, f)) for r, _, fs in os.walk("data") for f in fs)[1]
try:
    got = open("answer.txt").read().strip()
except FileNotFoundError:
    sys.exit("FAIL: answer.txt is missing")
if os.path.normpath(got.removeprefix("./")) != best:
    sys.exit(f"FAIL: answer.txt says {got!r}")
print("ok")
