"""Local clusters, benchmarks and the demo."""
