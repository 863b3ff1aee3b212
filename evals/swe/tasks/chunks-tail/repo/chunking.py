def chunks(items, size):
    """Consecutive slices of `size` items; the last may be shorter."""
    return [items[i:i + size] for i in range(0, len(items) - size + 1, size)]
