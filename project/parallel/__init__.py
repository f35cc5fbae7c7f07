"""Parallelism applied to the model from outside: one module per technique."""

from project.parallel.batch import BatchPlan, plan_batches
from project.parallel.mesh import mesh_shape

__all__ = ["BatchPlan", "mesh_shape", "plan_batches"]
