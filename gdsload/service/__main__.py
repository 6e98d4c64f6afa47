"""`python -m gdsload.service ROOT... --listen HOST:PORT`: the same as `gdsload serve`."""

import argparse
import os
import sys

from gdsload.errors import GdsloadError
from gdsload.service.cli import configure_serve_parser


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gdsload.service", description="gdsload serve")
    configure_serve_parser(p)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except GdsloadError as exc:
        if os.environ.get("GDSLOAD_DEBUG"):
            raise
        print(f"gdsload serve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
