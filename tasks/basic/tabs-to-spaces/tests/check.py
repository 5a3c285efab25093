import json, os, subprocess, sys
orig = json.load(open("/tests/orig.json"))
for path, text in orig.items():
    try:
        got = open(path).read()
    except FileNotFoundError:
        sys.exit(f"FAIL: {path} is missing")
    want = text.replace("\t", "    ") if path.endswith(".py") else text
    if got != want:
        sys.exit(f"FAIL: {path} is not as expected")
r = subprocess.run([sys.executable, "src/app.py"], capture_output=True, text=True)
if r.stdout.split() != ["0", "1", "2"]:
    sys.exit("FAIL: src/app.py no longer runs")
print("ok")
