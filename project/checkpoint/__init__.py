"""Checkpoints: read, verify and convert between layouts (files), the atomic swap that never loses the last
good one (files), and the weights read one file at a time (weights). Import each by its module."""
