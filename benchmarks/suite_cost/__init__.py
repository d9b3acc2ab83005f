"""What the test suite costs, per module: CPU seconds (with every child process's) and
interpreter starts. See the "Test suite cost" section of benchmarks/RESULTS.md."""
