import pytest
from calc import divide


def test_divide_whole():
    assert divide(8, 2) == 4


def test_divide_fraction():
    assert divide(7, 2) == 3.5


def test_divide_by_zero():
    with pytest.raises(ZeroDivisionError):
        divide(1, 0)
