"""The Llama model (llama: torch only; no distributed, Lightning or Hydra) and its arithmetic (config, flops:
no torch, so that settings checks can size a model before torch is loaded). Import each by its module."""
