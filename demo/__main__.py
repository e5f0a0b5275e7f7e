"""``python -m demo`` (from the repository root) runs the same demo as ``python demo/demo.py``."""

import sys

from demo.demo import main

if __name__ == "__main__":
    sys.exit(main())
