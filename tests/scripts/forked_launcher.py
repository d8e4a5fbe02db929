"""A launcher that starts one forked worker (``forked_mains.wait_forever``), prints its pid, and waits: the test
SIGKILLs it and checks that the worker goes too."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: forked_mains

from forked_mains import wait_forever  # noqa: E402
from gasloc_lightning.app.forked_workers import start_forked  # noqa: E402
from gasloc_lightning.strategies.launcher import LAUNCHER_PID_ENV  # noqa: E402

if __name__ == "__main__":
    log = Path(sys.argv[1])
    worker = start_forked(wait_forever, [], log, {"PATH": os.environ.get("PATH", ""), LAUNCHER_PID_ENV: str(os.getpid())})
    print(worker.pid, flush=True)
    while True:
        time.sleep(1)
