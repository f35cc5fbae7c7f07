from project.callbacks.checkpoint import BestCheckpoint, StepCheckpoint
from project.callbacks.layout import LayoutFacts
from project.callbacks.memory import MemoryMonitor
from project.callbacks.progress import StepProgressBar
from project.callbacks.summary import LlamaModelSummary
from project.callbacks.throughput import TokenThroughput

__all__ = [
    "BestCheckpoint",
    "LayoutFacts",
    "LlamaModelSummary",
    "MemoryMonitor",
    "StepCheckpoint",
    "StepProgressBar",
    "TokenThroughput",
]
