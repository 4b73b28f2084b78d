"""The `opledger` command line: `cli` (the parser and the inspection commands),
`processes` (the commands that run processes), `parsing` (global options, exit
codes, and the one way flags become `Settings`)."""
