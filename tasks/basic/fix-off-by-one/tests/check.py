import random, sys
sys.path.insert(0, ".")
try:
    from window import moving_sums
except Exception as e:
    sys.exit(f"FAIL: cannot import window.moving_sums: {e}")

def ref(xs, k):
    return [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)]

rng = random.Random(7)
cases = [([1, 2, 3, 4], 2), ([5], 1), ([1, 2], 3), ([], 1)]
cases += [([rng.randint(-50, 50) for _ in range(rng.randint(0, 30))], rng.randint(1, 6)) for _ in range(200)]
for xs, k in cases:
    got = moving_sums(list(xs), k)
    if got != ref(xs, k):
        sys.exit(f"FAIL: moving_sums({xs}, {k}) = {got}, expected {ref(xs, k)}")
try:
    moving_sums([1], 0)
    sys.exit("FAIL: k=0 must still raise ValueError")
except ValueError:
    pass
print("ok")
