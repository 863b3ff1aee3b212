from slug import slugify


def test_punctuation_dropped():
    assert slugify("a, b; c") == "a-b-c"


def test_lower_case():
    assert slugify("Hello World") == "hello-world"
