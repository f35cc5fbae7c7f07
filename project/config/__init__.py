"""Settings checks that need no process, run before torch and Lightning are imported (the one-second error):
checks.preflight runs them all: command_line, values, layout, trainer, data, checkpoints. Import each by its module."""
