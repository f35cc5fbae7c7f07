"""`python -m project.report`: a table and plots of finished runs (the work is in project.tooling.report)."""

import sys

from project.tooling.report import main

if __name__ == "__main__":
    sys.exit(main())
