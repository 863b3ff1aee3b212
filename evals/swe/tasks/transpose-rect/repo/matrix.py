def transpose(m):
    """Rows become columns."""
    n = len(m)
    return [[m[r][c] for r in range(n)] for c in range(n)]
