"""`python -m ledger.server ARGS`: an alias of `opledger serve ARGS`."""

import sys

from ledger.server.main import run_service_main

sys.exit(run_service_main())
