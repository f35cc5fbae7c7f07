"""Pretrain Llama-style models with PyTorch Lightning.

The entry points sit here (`python -m project.train|prepare|export|generate|plan|sweep|report`); everything
else lives in a package of its own concern, and imports point one way:

    entry points -> planning -> training -> parallel, data, checkpoint, hf -> model
                                config and runtime, beside them all

What is not the product lies beside the package: tools/ (the GPU check, the report, the offline sweep runner, the
configuration-reference generator; project.report and project.sweep run two of them) and benchmarks/ (make bench).

The package imports nothing itself, so that an entry point's settings check runs before torch is loaded.
"""
