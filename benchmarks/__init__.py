"""`make bench`: measurements of the platform on this machine, each a module run as `python -m benchmarks.NAME`,
writing new dated files into experiments/benchmarks/ (benchmarks.runner holds what they share)."""
