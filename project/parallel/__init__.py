"""Parallelism applied to the model from outside: one module per technique."""

from project.parallel.batch import BatchPlan, plan_batches, plan_pipeline_batches
from project.parallel.mesh import MeshShape, mesh_shape

__all__ = ["BatchPlan", "MeshShape", "mesh_shape", "plan_batches", "plan_pipeline_batches"]
