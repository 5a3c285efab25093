import os, subprocess, sys
need_dirs = ["project", "project/src", "project/tests", "project/docs"]
for d in need_dirs:
    if not os.path.isdir(d):
        sys.exit(f"FAIL: {d}/ is missing")
for f in ["project/src/__init__.py", "project/tests/__init__.py"]:
    if not os.path.isfile(f) or os.path.getsize(f) != 0:
        sys.exit(f"FAIL: {f} must exist and be empty")
if os.listdir("project/docs"):
    sys.exit("FAIL: project/docs must be empty")
try:
    first = open("project/README.md").readline().rstrip("\n")
except FileNotFoundError:
    sys.exit("FAIL: project/README.md is missing")
if first != "# project":
    sys.exit(f"FAIL: README.md starts with {first!r}")
r = subprocess.run([sys.executable, "project/src/main.py"], capture_output=True, text=True, timeout=10)
if r.returncode != 0 or r.stdout.strip() != "hello":
    sys.exit(f"FAIL: main.py printed {r.stdout!r}")
print("ok")
