"""Data: raw text -> tokenizer -> litdata token shards (offline), and the datamodule that streams them.

Import each part by its module (project.data.prepare, project.data.datamodule, ...): the package itself
imports nothing, so that the settings check can read sources (project.data.corpus) before torch, the
preparation side starts without Lightning, and the datamodule without the preparation's workers.
"""
