"""`python -m baton.local.run_module MODULE ARGS...`: run one `baton` subcommand module.

The same add_arguments/run protocol as baton/cli.py, addressed by module so the local
runtime does not depend on which names the CLI table uses.
"""

from __future__ import annotations

import argparse
import importlib
import sys


def main(argv: list[str]) -> int:
    module = importlib.import_module(argv[0])
    parser = argparse.ArgumentParser(prog=argv[0])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
