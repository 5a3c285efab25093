import sys


def summarize(path):
    values = []
    for line in open(path):
        line = line.strip()
        if line:
            values.append(float(line)
    total = sum(values)
    return f"count={len(values)} total={totl:g} mean={total / len(values):.2f}"


if __name__ == "__main__":
    print(summarize(sys.argv[1] if len(sys.argv) > 1 else "numbers.txt"))
