"""Helpers shared by the test suite: starting and stopping real server processes."""
