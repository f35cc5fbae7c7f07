from project.callbacks.progress import StepProgressBar
from project.callbacks.throughput import TokenThroughput

__all__ = ["StepProgressBar", "TokenThroughput"]
