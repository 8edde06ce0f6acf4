"""threadgraph's benchmarks and the renderer of their results: ``python -m benchmarks --help``."""
