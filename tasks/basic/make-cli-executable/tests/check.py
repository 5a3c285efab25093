import os, random, string, subprocess, sys
if not os.access("shout.py", os.X_OK):
    sys.exit("FAIL: shout.py is not executable")
words = ["".join(random.choice(string.ascii_lowercase) for _ in range(5)) for _ in range(3)]
try:
    r = subprocess.run(["./shout.py", *words], capture_output=True, text=True, timeout=10)
except OSError as e:
    sys.exit(f"FAIL: ./shout.py does not run: {e}")
if r.stdout.strip() != " ".join(words).upper():
    sys.exit(f"FAIL: ./shout.py printed {r.stdout!r}")
print("ok")
