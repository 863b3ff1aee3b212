from stack import Stack


def test_pop_order():
    s = Stack()
    s.push(1)
    s.push(2)
    assert s.pop() == 2


def test_peek_top():
    s = Stack()
    s.push(1)
    s.push(2)
    assert s.peek() == 2
