import collections, re, sys
c = collections.Counter(w.lower() for w in re.findall(r"[A-Za-z]+", open("/tests/book.txt").read()))
top = c.most_common(3)
want = [f"{w} {n}" for w, n in top]
try:
    got = [l.strip() for l in open("answer.txt") if l.strip()]
except FileNotFoundError:
    sys.exit("FAIL: answer.txt is missing")
if [" ".join(g.split()) for g in got] != want:
    sys.exit(f"FAIL: answer.txt has {got}")
print("ok")
