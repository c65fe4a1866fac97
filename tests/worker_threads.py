"""How many intra-op threads each process a test runs torch in gets."""

from __future__ import annotations

import os
import sys


def worker_threads() -> int:
    """This machine's cores shared between pytest-xdist's workers (`make test` runs two),
    all of them without xdist; OMP_NUM_THREADS, where set, says instead.

    An OpenMP team whose threads wait for cores another process holds stalls at every op's
    barrier: beside one busy single-threaded process (the other worker compiling, say) a
    SmolLM2 decode step on two threads runs 20x slower than on one, and a Ray actor's
    tiny-model steps 8x. Ray tests size their actors' pools with this (`torch_threads`)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


def share_cores_between_workers() -> None:
    """Under xdist, this process's torch and whatever it starts (servers, local Ray's
    workers) take `worker_threads()`: OMP_NUM_THREADS, set before torch is imported."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        os.environ["OMP_NUM_THREADS"] = str(worker_threads())
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(worker_threads())
