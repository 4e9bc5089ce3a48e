"""A child for the fork server's own tests: says it is up, then waits to be stopped (``main`` as a peer's)."""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> int:
    print("idle", flush=True)
    while True:
        time.sleep(1.0)
    return 0  # unreachable: it ends by a signal


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
