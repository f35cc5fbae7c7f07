"""Tools beside the training core, never imported by it: benchmarks (bench*), reports and their plots, and
the sweep runner."""
