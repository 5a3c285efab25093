import random, signal, sys
sys.path.insert(0, ".")
from search import find

signal.signal(signal.SIGALRM, lambda *a: sys.exit("FAIL: find() did not finish (infinite loop?)"))
signal.alarm(2)

class Counting(list):
    reads = 0
    def __getitem__(self, i):
        Counting.reads += 1
        return list.__getitem__(self, i)

rng = random.Random()
for _ in range(400):
    items = sorted(rng.sample(range(-200, 200), rng.randint(0, 40)))
    target = rng.randint(-210, 210)
    got = find(items, target)
    if target in items:
        if got < 0 or items[got] != target:
            sys.exit(f"FAIL: find({items}, {target}) = {got}")
    elif got != -1:
        sys.exit(f"FAIL: find({items}, {target}) = {got}, expected -1")
big = Counting(range(0, 2_000_000, 2))
for t in (0, 1_999_998, 777_776, 3):
    Counting.reads = 0
    find(big, t)
    if Counting.reads > 200:
        sys.exit(f"FAIL: {Counting.reads} reads for one lookup: not a binary search")
print("ok")
