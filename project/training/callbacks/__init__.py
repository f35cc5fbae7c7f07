from project.training.callbacks.checkpoint import BestCheckpoint, StepCheckpoint
from project.training.callbacks.evaluation import HeldOutEvaluation
from project.training.callbacks.hangs import HangWatch
from project.training.callbacks.layout import LayoutFacts
from project.training.callbacks.memory import MemoryMonitor
from project.training.callbacks.numerics import NumericsMonitor
from project.training.callbacks.progress import StepProgressBar, StepRichProgressBar
from project.training.callbacks.replicas import ReplicaCheck
from project.training.callbacks.stragglers import StragglerWatch
from project.training.callbacks.summary import LlamaModelSummary
from project.training.callbacks.throughput import TokenThroughput
from project.training.callbacks.timeouts import CollectiveTimeouts

__all__ = [
    "BestCheckpoint",
    "CollectiveTimeouts",
    "HangWatch",
    "HeldOutEvaluation",
    "LayoutFacts",
    "LlamaModelSummary",
    "MemoryMonitor",
    "NumericsMonitor",
    "ReplicaCheck",
    "StepCheckpoint",
    "StepProgressBar",
    "StepRichProgressBar",
    "StragglerWatch",
    "TokenThroughput",
]
