import random, string, sys
sys.path.insert(0, ".")
try:
    from text_tools import is_palindrome
except Exception as e:
    sys.exit(f"FAIL: cannot import: {e}")

def ref(t):
    k = [c.lower() for c in t if c.isalnum()]
    return k == k[::-1]

rng = random.Random()
cases = ["A man, a plan, a canal: Panama!", "abc", "", "No 'x' in Nixon", "12321", "123", "Ab,bA", "ab"]
for _ in range(300):
    half = "".join(rng.choice("abcXYZ19 ,.!") for _ in range(rng.randint(0, 8)))
    s = half + rng.choice(["", "q", "7"]) + half[::-1]
    cases.append(s if rng.random() < 0.5 else s + rng.choice("abz"))
for c in cases:
    try:
        got = is_palindrome(c)
    except Exception as e:
        sys.exit(f"FAIL: is_palindrome({c!r}) raised {e!r}")
    if got is not ref(c):
        sys.exit(f"FAIL: is_palindrome({c!r}) returned {got!r}")
print("ok")
