"""`python -m gdsload.service ROOT... --listen HOST:PORT`: the same as `gdsload serve`."""

import argparse
import sys

from gdsload.cli import run
from gdsload.cli.serve import configure_serve_parser


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gdsload.service", description="gdsload serve")
    configure_serve_parser(p)
    return run(p.parse_args(argv), "serve")


if __name__ == "__main__":
    sys.exit(main())
