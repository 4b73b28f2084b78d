"""`python -m ledger.server`: the ledger service."""

import sys

from ledger.server.main import run_service_main

sys.exit(run_service_main())
