"""``python -m workers``: run envs for a zmqpool trainer."""

import logging
import os
import sys

from workers.cli import main

if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown (seconds with torch loaded): sockets and
    # envs are already closed, and close() in the pool is bounded in time.
    os._exit(code)
