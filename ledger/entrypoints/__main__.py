"""`python -m ledger.entrypoints`: the `opledger` command."""

import sys

from ledger.entrypoints.cli import main

sys.exit(main())
