import sys

from gdsload.cli import main

sys.exit(main())
