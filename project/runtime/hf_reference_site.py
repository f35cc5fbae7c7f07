"""`make install` copies this file to .venv/hf-reference/sitecustomize.py, which Python runs at the start of every
process with that folder on its path (`PYTHONPATH=.venv/hf-reference python -c 'from transformers import ...'`, as
the docs load an export): transformers imports torchao wherever it is installed, and torchao's import logs lines no
user can act on (project.runtime.console.IMPORT_NOISE), filtered here before anything is imported."""

try:
    from project.runtime.console import silence_import_noise
except ImportError:  # a Python without this project installed: nothing to filter with
    pass
else:
    silence_import_noise()
