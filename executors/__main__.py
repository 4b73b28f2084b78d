"""`python -m executors run MODULE:TOOL ...`: `opledger executor run` without the settings
(see `executors._main`)."""

import sys

from executors._main import run_executor_main

raise SystemExit(run_executor_main(sys.argv[1:]))
