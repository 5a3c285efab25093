import os, random, stat, subprocess, sys, tempfile
rng = random.Random()
for trial in range(4):
    nums = [rng.randint(-500, 500) for _ in range(rng.randint(1, 25))]
    fd, path = tempfile.mkstemp()
    with os.fdopen(fd, "w") as f:
        f.write("# header comment\n")
        for n in nums:
            f.write(f"{n}\n" + ("\n" if rng.random() < 0.2 else "") + ("# note\n" if rng.random() < 0.1 else ""))
        if rng.random() < 0.5:
            f.write(str(rng.randint(-9, 9)))  # a last line with no newline
    total = sum(int(l) for l in open(path).read().splitlines() if l.strip() and not l.startswith("#"))
    r = subprocess.run(["bash", "sum.sh", path], capture_output=True, text=True, timeout=10)
    if r.stdout.strip() != str(total):
        sys.exit(f"FAIL: sum.sh printed {r.stdout.strip()!r}, expected {total}")
print("ok")
