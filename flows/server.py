"""The Prefect API a verb talks to: the user's server when one is configured, else one of our own.

``PREFECT_API_URL`` (environment, or the active Prefect profile) names the user's server and
is used as is.  Otherwise a verb that has work to do starts a private server, as Prefect's
ephemeral mode would (``uvicorn prefect.server.api.server:create_app``, the command of
``SubprocessASGIServer`` in prefect/server/api/server.py), but owned by us, so that:

* its home (SQLite database, logs) is created before it starts (a missing output folder made
  Prefect's own temporary server time out after 90 s);
* it starts while the verb is still importing, from a migrated template database when one
  exists (a fresh database spends ~10 s in migrations);
* it never outlives the verb: it is stopped on exit, SIGINT and SIGTERM; on Linux the kernel
  sends it SIGTERM when the verb dies (PR_SET_PDEATHSIG); and a pidfile records it, so after a
  SIGKILL elsewhere the next start in the same home finds the orphan and stops it.

This module imports nothing from Prefect: the no-op path and the server start stay fast.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

from diffsynth_core.errors import EnvironmentFailure, InputError

from .signals import deferred

PIDFILE_PREFIX = "splitflow-server-"
STARTUP_TIMEOUT_S = 90.0
# Runs in the server's process before uvicorn: die with the verb (Linux), and give up if the
# verb is already gone (the race between fork and prctl).
_LAUNCHER = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
os.execv(sys.executable, [sys.executable, "-m", "uvicorn", *sys.argv[2:]])
"""


def _profile_api_url() -> str | None:
    """PREFECT_API_URL from the active profile of the user's Prefect home (prefect/settings/profiles.py)."""
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active")
    return (profiles.get("profiles", {}).get(active) or {}).get("PREFECT_API_URL") or None


def configured_api_url() -> str | None:
    """The user's Prefect API: the environment, an in-process setting (tests), or the active profile."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    if "prefect.settings" in sys.modules:  # e.g. prefect_test_harness in this process
        from prefect.settings import PREFECT_API_URL

        if PREFECT_API_URL.value():
            return PREFECT_API_URL.value()
    return _profile_api_url()


def api_healthy(api_url: str, timeout: float = 2.0) -> bool:
    """Whether the API answers at all (an auth or routing error from a live server counts as up)."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as response:
            return response.status == 200
    except urllib.error.HTTPError as err:
        return err.code < 500
    except OSError:
        return False


# -- process identity (pid reuse must never make us kill a stranger) ---------------------------
def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid: int, ticks: int | None) -> bool:
    if ticks is not None and Path("/proc").is_dir():
        return _start_ticks(pid) == ticks
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _terminate(pid: int, grace_s: float = 5.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _start_ticks(pid) is not None:
            time.sleep(0.1)
        if _start_ticks(pid) is not None:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reap_orphans(home: Path) -> list[int]:
    """Stop servers this home's pidfiles record whose owning verb is gone; return their pids."""
    stopped = []
    for pidfile in home.glob(f"{PIDFILE_PREFIX}*.json"):
        try:
            record = json.loads(pidfile.read_text())
        except (OSError, ValueError):
            continue
        if _alive(record["owner"], record.get("owner_ticks")):
            continue  # another verb's live server
        if _alive(record["pid"], record.get("ticks")):
            _terminate(record["pid"])
            stopped.append(record["pid"])
        pidfile.unlink(missing_ok=True)
    return stopped


# -- the template database ---------------------------------------------------------------------
def _template_db() -> Path:
    from cache_store.digests import memo_dir  # splitflow's cache folder (SPLITFLOW_CACHE_DIR)

    return memo_dir() / f"prefect-{importlib.metadata.version('prefect')}.db"


def _seed_database(home: Path) -> bool:
    """Copy the migrated empty database into a new home; False when there is none yet."""
    database, template = home / "prefect.db", _template_db()
    if database.exists() or not template.is_file():
        return False
    tmp = database.with_name(f".prefect.db.{os.getpid()}")
    tmp.write_bytes(template.read_bytes())
    tmp.replace(database)
    return True


def _save_template(home: Path) -> None:
    """Keep a consistent copy (sqlite backup API) of a just-migrated database for later homes."""
    template = _template_db()
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        tmp = template.with_name(f".{template.name}.{os.getpid()}")
        source, target = sqlite3.connect(home / "prefect.db"), sqlite3.connect(tmp)
        try:
            source.backup(target)
        finally:
            source.close()
            target.close()
        tmp.replace(template)
    except (OSError, sqlite3.Error):
        pass  # an optimisation only: the next fresh home migrates again


# -- our own server ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalServer:
    """A private Prefect server on 127.0.0.1 for one verb: ``start``, ``wait_healthy``, ``stop``."""

    def __init__(self, home: Path):
        self.home = Path(home)
        self.port = _free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.pidfile = self.home / f"{PIDFILE_PREFIX}{self.port}.json"
        self.process: subprocess.Popen | None = None
        self._fresh = False

    def start(self) -> "LocalServer":
        self.home.mkdir(parents=True, exist_ok=True)
        reap_orphans(self.home)
        self._fresh = not (self.home / "prefect.db").exists() and not _seed_database(self.home)
        app_dir = Path(importlib.util.find_spec("prefect").origin).parents[1]
        env = {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_UI_ENABLED": "0",
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT__SERVER_EPHEMERAL": "1"}
        env.pop("PREFECT_API_URL", None)
        args = ["--app-dir", str(app_dir), "--factory", "prefect.server.api.server:create_app",
                "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
        with open(self.home / "server.log", "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(os.getpid()), *args],
                                            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            start_new_session=True)
        record = {"pid": self.process.pid, "ticks": _start_ticks(self.process.pid), "port": self.port,
                  "owner": os.getpid(), "owner_ticks": _start_ticks(os.getpid())}
        self.pidfile.write_text(json.dumps(record))
        return self

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while not api_healthy(self.api_url, timeout=1.0):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise EnvironmentFailure(
                    f"the Prefect server for this run did not start (see {self.home / 'server.log'}); "
                    "set PREFECT_API_URL to use a running server instead")
            time.sleep(0.1)
        if self._fresh:
            _save_template(self.home)
            self._fresh = False
        return self.api_url

    def stop(self) -> None:
        with deferred():  # a Ctrl-C or SIGTERM arriving now is raised once the server is down
            if self.process is not None and self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None
            self.pidfile.unlink(missing_ok=True)


class ApiSession:
    """The API of one verb: ``start`` (spawns our server if needed), ``ready`` (waits), ``close``.

    ``url``: :func:`configured_api_url`, read before the verb points PREFECT_HOME elsewhere.

    Between ``start`` and ``ready`` the verb imports Prefect and the stages while the server boots.
    ``shared``: the work needs a server that workers reach too (pools): ours will not do.
    """

    def __init__(self, url: str | None, home: Path, shared: bool, grace_s: float):
        self.url, self.home, self.shared, self.grace_s = url, Path(home), shared, grace_s
        self.server: LocalServer | None = None

    def start(self) -> "ApiSession":
        if self.url is None and self.shared:
            raise InputError("work pools need a Prefect server the workers reach too: start one "
                             "(prefect server start) and set PREFECT_API_URL (docs/orchestration.md)")
        if self.url is None:
            self.server = LocalServer(self.home).start()
            self.url = self.server.api_url
        return self

    def ready(self) -> str:
        if self.server is not None:
            return self.server.wait_healthy()
        deadline = time.monotonic() + self.grace_s
        while not api_healthy(self.url):
            if time.monotonic() > deadline:
                raise EnvironmentFailure(f"Prefect API at {self.url} unreachable for {self.grace_s:g} s "
                                         "(orchestration.api_grace_s): start the server or fix PREFECT_API_URL")
            time.sleep(1.0)
        return self.url

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
