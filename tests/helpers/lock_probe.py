"""A child for the fork server's tests: ``hold`` takes hivemind's process-wide locks and waits to be killed with them
held; ``take`` takes them within a few seconds or says which it could not (``main`` as a peer's)."""

from __future__ import annotations

import sys
import time
from typing import Any


def _locks() -> dict[str, Any]:
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    return {
        "MPFuture._initialization_lock": MPFuture._initialization_lock,
        "MPFuture._update_lock": MPFuture._update_lock,
        "SharedBytes._lock": SharedBytes._lock,
        "_AsyncContextWrapper.EXECUTOR_LOCK": _AsyncContextWrapper.EXECUTOR_LOCK,
    }


def main(argv: list[str]) -> int:
    locks = _locks()
    if argv[0] == "hold":
        for lock in locks.values():
            lock.acquire()
        print("holding", flush=True)
        while True:
            time.sleep(1.0)
    stuck = [name for name, lock in locks.items() if not lock.acquire(timeout=5.0)]
    print(f"stuck: {stuck}" if stuck else "took every lock", flush=True)
    return 1 if stuck else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
