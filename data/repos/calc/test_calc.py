"""Tests for calc.add: run with `python3 -m unittest test_calc`."""

import unittest

from calc import add

CASES = [(a, 2 * a + 1, 3 * a + 1) for a in range(40)]


class TestAdd(unittest.TestCase):
    def test_add(self):
        for a, b, expected in CASES:
            with self.subTest(a=a, b=b):
                self.assertEqual(add(a, b), expected)


if __name__ == "__main__":
    unittest.main()
