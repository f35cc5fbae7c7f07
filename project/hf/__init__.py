"""Hugging Face's Llama format: config and weight conversion, published weights to start from, the export of
a checkpoint, and the folder checks. Import each by its module."""
