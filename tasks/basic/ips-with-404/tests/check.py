import sys
ips = sorted({l.split()[0] for l in open("/tests/access.log") if l.split()[8] == "404"})
try:
    got = open("ips.txt").read().split()
except FileNotFoundError:
    sys.exit("FAIL: ips.txt is missing")
if got != ips:
    sys.exit(f"FAIL: ips.txt has {len(got)} lines, expected {len(ips)} (or wrong order)")
print("ok")
