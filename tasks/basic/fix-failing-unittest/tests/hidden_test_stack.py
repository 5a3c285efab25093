import unittest

from stack import Stack


class HiddenStackTest(unittest.TestCase):
    def test_lifo_long(self):
        s = Stack()
        for i in range(100):
            s.push(i)
        self.assertEqual([s.pop() for _ in range(100)], list(range(99, -1, -1)))
        self.assertEqual(len(s), 0)

    def test_peek_does_not_remove(self):
        s = Stack()
        s.push(1)
        s.push(2)
        self.assertEqual(s.peek(), 2)
        self.assertEqual(s.peek(), 2)
        self.assertEqual(s.pop(), 2)
        self.assertEqual(s.peek(), 1)

    def test_interleaved(self):
        s = Stack()
        s.push("a"); s.push("b"); self.assertEqual(s.pop(), "b")
        s.push("c"); self.assertEqual(s.pop(), "c"); self.assertEqual(s.pop(), "a")

    def test_empty(self):
        with self.assertRaises(IndexError):
            Stack().pop()
