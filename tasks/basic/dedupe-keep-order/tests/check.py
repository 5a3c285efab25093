import sys
seen, want = set(), []
for l in open("/tests/emails.txt").read().splitlines():
    if l not in seen:
        seen.add(l)
        want.append(l)
try:
    got = open("unique.txt").read().splitlines()
except FileNotFoundError:
    sys.exit("FAIL: unique.txt is missing")
if got != want:
    sys.exit(f"FAIL: unique.txt has {len(got)} lines, expected {len(want)} in first-seen order")
print("ok")
