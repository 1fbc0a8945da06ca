"""Benchmarks: scripts that print their figures and write bench/results/latest.json (`make bench`).
Nothing here is a timed test; every comparison is a ratio measured in the same run."""
