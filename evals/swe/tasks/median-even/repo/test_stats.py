from stats import mean, median


def test_mean_and_odd_median():
    assert mean([1, 2, 3]) == 2
    assert median([3, 1, 2]) == 2


def test_even_median():
    assert median([4, 1, 3, 2]) == 2.5
