def parse_kv(text):
    """`k=v;k2=v2` into a dict."""
    out = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        key, value = part.split("=")
        out[key.strip()] = value.strip()
    return out
