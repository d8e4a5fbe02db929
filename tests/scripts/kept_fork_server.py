"""Two "runs" inside ``fork_server_kept()``, each ending with ``stop_fork_server()`` as the launcher's runs do: prints
the server pid of each run's worker, then whether that server still runs after the block (it must not)."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: forked_mains

from forked_mains import report_parent_and_exit  # noqa: E402
from gasloc_lightning.app.forked_workers import fork_server_kept, start_forked, stop_fork_server  # noqa: E402


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


if __name__ == "__main__":
    folder, servers = Path(sys.argv[1]), []
    with fork_server_kept():
        for run in range(2):
            log = folder / f"run_{run}.log"
            assert start_forked(report_parent_and_exit, [], log, {"PATH": os.environ.get("PATH", "")}).wait(120) == 0
            servers.append(int(log.read_text().split()[-1]))
            stop_fork_server()  # the end of a run: the server is kept
            assert _alive(servers[-1])
    print(json.dumps({"servers": servers, "alive_after": _alive(servers[0])}), flush=True)
