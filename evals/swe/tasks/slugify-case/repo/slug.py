import re


def slugify(text):
    """URL slug: words joined by hyphens, lower case, no punctuation."""
    words = re.findall(r"[A-Za-z0-9]+", text)
    return "-".join(words)
