"""``python -m workers``: run envs for a zmqpool trainer."""

import logging
import os
import sys


def _main() -> int:
    """``workers.cli.main``, its import included: a Ctrl-C may land anywhere, even there."""
    try:
        from workers.cli import main

        return main()
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    code = _main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown (seconds with torch loaded): sockets and
    # envs are already closed, and close() in the pool is bounded in time.
    os._exit(code)
