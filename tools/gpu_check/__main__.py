"""`python -m tools.gpu_check`: the command of this package."""

from tools.gpu_check import main

if __name__ == "__main__":
    main()
