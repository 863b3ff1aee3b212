import pytest
from inventory import Inventory


def test_add_remove():
    inv = Inventory()
    inv.add("apple", 3)
    inv.remove("apple", 1)
    assert inv.stock["apple"] == 2


def test_remove_too_many():
    inv = Inventory()
    inv.add("apple", 2)
    with pytest.raises(ValueError):
        inv.remove("apple", 5)
    assert inv.stock["apple"] == 2
