"""The parallelism planner: memory and step time of every layout of a model on a cluster (project.plan)."""
