import hashlib, json, os, sys
want = json.load(open("/tests/hashes.json"))
names = sorted(os.listdir("photos"))
if "notes.txt" not in names or open("photos/notes.txt").read() != "keep me as I am\n":
    sys.exit("FAIL: photos/notes.txt was changed or removed")
rest = sorted(n for n in names if n != "notes.txt")
if rest != sorted(want):
    sys.exit(f"FAIL: photos/ holds {rest}")
for name, h in want.items():
    if hashlib.sha256(open(os.path.join("photos", name), "rb").read()).hexdigest() != h:
        sys.exit(f"FAIL: {name} does not hold the original picture")
print("ok")
