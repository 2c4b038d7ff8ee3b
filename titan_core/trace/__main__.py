"""Entry point: ``python -m titan_core.trace analyze TRACE_DIR --out REPORT_DIR``."""

import sys

from titan_core.trace.cli import main

if __name__ == "__main__":
    sys.exit(main())
