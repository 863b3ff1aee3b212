from kvparse import parse_kv


def test_pairs():
    assert parse_kv("a=1; b=2;") == {"a": "1", "b": "2"}


def test_value_with_equals():
    assert parse_kv("url=a=b") == {"url": "a=b"}
