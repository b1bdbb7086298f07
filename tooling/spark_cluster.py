"""A Spark standalone cluster of one's own on this machine: a master and workers started from
pyspark's own distribution (``spark-class ...deploy.master.Master`` / ``...deploy.worker.Worker``),
bound to 127.0.0.1 on free ports, for the tests and the report benchmark.

    with StandaloneCluster(workers=2, cores=1, memory="1g") as cluster:
        run_report(ReportOptions(master=cluster.url), ...)

Every process runs in a process group of its own and is killed with it on exit, also when the
body failed. ``ClusterUnavailable`` means a component cannot exist here (no Java, no pyspark);
any other failure to come up raises RuntimeError with the processes' log.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from tooling.processes import free_port


class ClusterUnavailable(RuntimeError):
    """Java or pyspark's distribution is not installed here."""


def spark_home() -> Path:
    """The installed pyspark package: it carries Spark's jars and ``bin/spark-class``."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise ClusterUnavailable("pyspark is not installed (pip install 'orderly[reports]')")
    home = Path(spec.origin).parent
    if not (home / "bin" / "spark-class").is_file():
        raise ClusterUnavailable(f"{home} has no bin/spark-class")
    return home


def java() -> str:
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not found or not Path(found).is_file():
        raise ClusterUnavailable("Java is not installed (no java on PATH, no JAVA_HOME)")
    return found


class StandaloneCluster:
    """A master and ``workers`` workers of ``cores`` cores and ``memory`` each."""

    def __init__(self, workers: int = 2, cores: int = 1, memory: str = "1g") -> None:
        self.java = java()
        self.home = spark_home()
        self.workers, self.cores, self.memory = workers, cores, memory
        self.dir = Path(tempfile.mkdtemp(prefix="orderly-spark-cluster-"))
        self.port = free_port()
        self.ui_port = free_port()
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @property
    def ui(self) -> str:
        return f"http://127.0.0.1:{self.ui_port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "SPARK_HOME": str(self.home),
                "JAVA_HOME": str(Path(self.java).resolve().parent.parent),
                "SPARK_LOCAL_IP": "127.0.0.1",
                "SPARK_LOG_DIR": str(self.dir / "logs"),
                "SPARK_CONF_DIR": str(self.dir / "conf"),  # none of this host's settings
                # Small daemons: the work runs in the executors the report asks for.
                "SPARK_DAEMON_MEMORY": "256m",
            }
        )
        return env

    def _start(self, name: str, *argv: str) -> None:
        log = (self.dir / f"{name}.log").open("ab")
        try:
            self._procs.append(
                subprocess.Popen(
                    [str(self.home / "bin" / "spark-class"), *argv],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self._env(),
                    cwd=self.dir,
                    start_new_session=True,  # its own process group: torn down as one
                )
            )
        finally:
            log.close()

    def start(self, timeout: float = 120.0) -> StandaloneCluster:
        (self.dir / "conf").mkdir()
        # No REST submission server: it would take the fixed port 6066, and nothing uses it.
        (self.dir / "conf" / "spark-defaults.conf").write_text("spark.master.rest.enabled false\n")
        self._start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--webui-port", str(self.ui_port),
        )  # fmt: skip
        for n in range(self.workers):
            work = self.dir / f"worker-{n}"
            work.mkdir()
            self._start(
                f"worker-{n}",
                "org.apache.spark.deploy.worker.Worker",
                "--host", "127.0.0.1",
                "--port", str(free_port()),
                "--webui-port", str(free_port()),
                "--cores", str(self.cores),
                "--memory", self.memory,
                "--work-dir", str(work),
                self.url,
            )  # fmt: skip
        self._wait_alive(timeout)
        return self

    def state(self) -> dict[str, Any]:
        """The master's view (its web UI's JSON): workers, applications."""
        with urllib.request.urlopen(f"{self.ui}/json/", timeout=5) as answer:
            state: dict[str, Any] = json.load(answer)
        return state

    def alive_workers(self) -> int:
        return sum(1 for w in self.state().get("workers", []) if w.get("state") == "ALIVE")

    def _wait_alive(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Spark daemon exited ({proc.returncode}):\n{self.logs()}")
            try:
                alive = self.alive_workers()
                if alive >= self.workers:
                    return
                last = f"{alive} of {self.workers} workers alive"
            except (OSError, ValueError) as exc:  # not listening yet, or an empty page
                last = str(exc)
            time.sleep(0.2)
        raise RuntimeError(
            f"the Spark cluster did not come up in {timeout}s ({last}):\n{self.logs()}"
        )

    def logs(self, tail: int = 40) -> str:
        parts = []
        for path in sorted(self.dir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for proc in reversed(procs):  # workers first, then the master
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> StandaloneCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
