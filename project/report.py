"""`python -m project.report`: a table and plots of finished runs (the work is in tools.report)."""

import sys

from tools.report import main

if __name__ == "__main__":
    sys.exit(main())
