import os, random, subprocess, sys, tempfile
if not os.access("count_ext.sh", os.X_OK):
    sys.exit("FAIL: count_ext.sh is missing or not executable")
rng = random.Random()
for trial in range(3):
    d = tempfile.mkdtemp()
    counts = {}
    for i in range(rng.randint(5, 30)):
        sub = os.path.join(d, *rng.sample(["x", "y", "z"], rng.randint(0, 2)))
        os.makedirs(sub, exist_ok=True)
        ext = rng.choice(["txt", "c", "h", "tar.gz", None, "json"])
        name = f"f{i}" + (f".{ext}" if ext else "")
        open(os.path.join(sub, name), "w").close()
        key = ext.rsplit(".", 1)[-1] if ext else "none"
        counts[key] = counts.get(key, 0) + 1
    want = "".join(f"{k} {v}\n" for k, v in sorted(counts.items()))
    r = subprocess.run(["./count_ext.sh", d], capture_output=True, text=True, timeout=10)
    if r.returncode != 0 or r.stdout != want:
        sys.exit(f"FAIL: on a test tree, got {r.stdout!r} (exit {r.returncode}), expected {want!r}")
print("ok")
