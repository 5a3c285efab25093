import os, random, shutil, subprocess, sys, tempfile
rng = random.Random()
for trial in range(4):
    d = tempfile.mkdtemp()
    shutil.copy("report.py", d)
    nums = [rng.randint(-100, 1000) for _ in range(rng.randint(1, 20))]
    with open(os.path.join(d, "numbers.txt"), "w") as f:
        for n in nums:
            f.write(f"{n}\n" + ("\n" if rng.random() < 0.2 else ""))
    total = float(sum(nums))
    want = f"count={len(nums)} total={total:g} mean={total / len(nums):.2f}"
    r = subprocess.run([sys.executable, "report.py"], cwd=d, capture_output=True, text=True, timeout=10)
    if r.stdout.strip() != want:
        sys.exit(f"FAIL: printed {r.stdout.strip()!r} (stderr {r.stderr[-300:]!r}), expected {want!r}")
print("ok")
