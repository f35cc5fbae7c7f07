"""Training: the LightningModule (lit_module), the run assembly that builds the Trainer and fits (run),
loggers, and callbacks. Import each by its module."""
