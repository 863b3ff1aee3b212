from words import count_words


def test_simple():
    assert count_words("one two three") == 3
    assert count_words("") == 0


def test_runs_of_whitespace():
    assert count_words("a  b") == 2
    assert count_words("a\tb\nc ") == 3
