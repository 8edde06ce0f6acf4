"""Helpers shared by the test suites: thread waits, GPU scenario scripts and their runner, tiny trainer runs, export fixtures."""
