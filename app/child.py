"""`python app.py` (or `python -m api`) as a child process on a free port, for tests, benchmarks and
scripts: started in its own process group with its output in a log, ready once a URL answers, and
stopped with the whole group (its engine's threads and any tensor-parallel ranks).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class DidNotStart(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], ready_url: str, log_path: Path, env: dict | None = None, timeout_s: float = 120,
          headers: dict | None = None) -> subprocess.Popen:
    """Run `command` from the project root; return once `ready_url` answers 200 (DidNotStart when the
    child exits first or `timeout_s` passes; the log says why)."""
    import httpx

    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", **(env or {}))
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise DidNotStart(f"{' '.join(command[1:3])} exited with code {proc.returncode}, see {log_path}")
        try:
            if httpx.get(ready_url, headers=headers, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop(proc)
            raise DidNotStart(f"{' '.join(command[1:3])} did not start in {timeout_s:.0f} s, see {log_path}")
        time.sleep(0.3)


def start_app(args: list[str], log_path: Path, env: dict | None = None, timeout_s: float = 120
              ) -> tuple[subprocess.Popen, str]:
    """`python app.py ARGS` on a free port: (process, its URL ending in /)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    proc = start([sys.executable, str(ROOT / "app.py"), *args], url + "gradio_api/info", log_path,
                 dict(env or {}, APP_PORT=str(port)), timeout_s)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's process group, SIGKILL after 10 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:  # already gone
        pass
