"""The worker side of zmqpool: processes that host envs and answer the pool's commands.

Run one with ``python -m workers --help``.
"""
