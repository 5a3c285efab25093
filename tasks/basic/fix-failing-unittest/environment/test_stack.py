import unittest

from stack import Stack


class StackTest(unittest.TestCase):
    def test_lifo(self):
        s = Stack()
        for i in range(3):
            s.push(i)
        self.assertEqual([s.pop(), s.pop(), s.pop()], [2, 1, 0])

    def test_peek(self):
        s = Stack()
        s.push("a")
        s.push("b")
        self.assertEqual(s.peek(), "b")
        self.assertEqual(len(s), 2)

    def test_empty(self):
        with self.assertRaises(IndexError):
            Stack().pop()


if __name__ == "__main__":
    unittest.main()
