"""Benchmark commands: each prints a table and writes JSON / Markdown / PNG."""
