"""`python -m baton.operator`: the same as `baton operator`."""

import argparse
import sys

from .main import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m baton.operator")
add_arguments(parser)
sys.exit(run(parser.parse_args()))
