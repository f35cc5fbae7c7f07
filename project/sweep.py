"""`python -m project.sweep`: run a sweep over parallelism degrees and settings (the work is in
project.tooling.sweep)."""

import sys

from project.tooling.sweep import main

if __name__ == "__main__":
    sys.exit(main())
