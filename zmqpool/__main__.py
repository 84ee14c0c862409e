"""``python -m zmqpool``: the ``zmqpool`` command (see :mod:`zmqpool.cli`)."""

import sys

from zmqpool.cli import main

if __name__ == "__main__":
    sys.exit(main())
