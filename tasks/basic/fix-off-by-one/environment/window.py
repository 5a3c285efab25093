def moving_sums(xs, k):
    """Sums of each run of k consecutive items of xs, in order."""
    if k <= 0:
        raise ValueError("k must be positive")
    out = []
    for i in range(len(xs) - k):
        out.append(sum(xs[i : i + k]))
    return out
