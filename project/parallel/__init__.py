"""Parallelism applied to the model from outside: one module per technique."""

from project.parallel.batch import BatchPlan, plan_batches
from project.parallel.mesh import data_parallel_size

__all__ = ["BatchPlan", "plan_batches", "data_parallel_size"]
