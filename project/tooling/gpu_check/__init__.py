"""`make gpu-check` (python -m project.gpu_check): environment, correctness, speed and the data path of a GPU
machine in ten minutes; the same plumbing on the CPU with a tiny model."""
