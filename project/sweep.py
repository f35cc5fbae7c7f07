"""`python -m project.sweep`: run a sweep over parallelism degrees and settings (the work is in
tools.sweep)."""

import sys

from tools.sweep import main

if __name__ == "__main__":
    sys.exit(main())
