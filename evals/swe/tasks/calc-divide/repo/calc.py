def divide(a, b):
    """Return a divided by b."""
    if b == 0:
        raise ZeroDivisionError("b must not be zero")
    return a // b
