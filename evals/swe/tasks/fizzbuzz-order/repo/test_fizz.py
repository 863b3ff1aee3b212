from fizz import fizzbuzz


def test_single():
    assert [fizzbuzz(i) for i in (1, 3, 5)] == ["1", "Fizz", "Buzz"]


def test_both():
    assert fizzbuzz(15) == "FizzBuzz"
    assert fizzbuzz(30) == "FizzBuzz"
