def count_words(text):
    """Number of whitespace-separated words."""
    if not text:
        return 0
    return len(text.split(" "))
