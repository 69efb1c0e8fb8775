"""The `mlmclm` subcommands: one thin module per subcommand, registered in cli.COMMANDS.

Each module holds the command-line surface of one step of the flow and nothing else:
`add_arguments(parser)` declares the flags, `run(args) -> int` checks what only the flags can get
wrong, calls the library (data/, training/, convert/, eval/, plan/, quickstart.py) and prints the
result. argparse lives here only; the library takes plain values. A module whose library is heavy
(torch, megatron-core, transformers) imports it inside `run`, so `mlmclm CMD --help` and the
parsing of documented commands (tests/test_doc_commands.py) stay fast.
"""
