from dates import days_in_year, is_leap


def test_common_rules():
    assert is_leap(2024)
    assert not is_leap(1900)
    assert days_in_year(2023) == 365


def test_divisible_by_400():
    assert is_leap(2000)
    assert days_in_year(2400) == 366
