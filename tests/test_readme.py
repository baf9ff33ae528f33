"""Issue 31: the README runs top to bottom. Its shell blocks run in order, as written, in a fresh copy of the
repository (servers started and stopped by the blocks themselves), so the README cannot drift again.

The copy's ``.venv`` is a thin venv over this checkout's: its ``python`` imports the copy's code first and the
installed packages from ``.venv``; the Makefile's install stamps are fresh, so ``make run`` installs nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
SETUP = ["make run", "make test"]
#: Blocks not run, by their first line, and why.
SKIPPED = {
    "streamflow run JOB --events FILE": "the command line's synopsis (placeholders)",
    "make broker-up && export STREAMFLOW_KAFKA_BOOTSTRAP": "serving: a foreground worker, over a model zoo built "
                                                           "once per machine (minutes)",
}


def blocks(kind: str) -> list[str]:
    """The README's fenced blocks of ``kind`` (bash, python), in order."""
    return re.findall(rf"^```{kind}\n(.*?)^```", README.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)


def commands(block: str) -> list[str]:
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_readme_opens_with_exactly_the_two_set_up_commands():
    assert commands(blocks("bash")[0]) == SETUP
    targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert {"run", "test"} <= set(targets)


def _thin_copy(root: Path) -> Path:
    """The tracked files of this checkout in ``root``, with a ``.venv`` that uses this checkout's packages."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    venv = root / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    installed = sysconfig.get_path("purelib")
    (site / "00-readme-test.pth").write_text(f"{root}\nimport site; site.addsitedir({installed!r})\n")
    bin_dir = Path(sys.executable).parent
    for script in ("streamflow",):
        (venv / "bin" / script).write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom streamflow.cli import main\n"
                                           "sys.exit(main())\n")
        (venv / "bin" / script).chmod(0o755)
    for tool in ("noida-db",):
        if (bin_dir / tool).exists():
            (venv / "bin" / tool).symlink_to(bin_dir / tool)
    for stamp in (".installed-core", ".installed-dev", ".installed-broker"):
        (venv / stamp).touch()
    return root


@pytest.mark.slow
def test_every_shell_block_of_the_readme_runs_in_order(tmp_path):
    pytest.importorskip("pyflink")
    pytest.importorskip("kafka")
    if shutil.which("java") is None or not (Path(sys.executable).parent / "noida-db").exists():
        pytest.skip("the README's Flink and tunnel sections need java and noida-db")
    root = _thin_copy(tmp_path / "streamflow")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFLOW_")}
    # Flink's embedded interpreter (pemja) reads no .pth of the thin venv: give it both paths directly
    env["PYTHONPATH"] = os.pathsep.join([str(root), sysconfig.get_path("purelib")])
    ran = []
    for block in blocks("bash"):
        first = commands(block)[0]
        if any(first.startswith(prefix) for prefix in SKIPPED):
            continue
        script = "make run\n" if commands(block) == SETUP else block  # `make test` is this suite
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=root, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"README block failed:\n{block}\nstdout:\n{done.stdout[-3000:]}\n" \
                                     f"stderr:\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        ran.append(first)
    assert len(ran) == len(blocks("bash")) - len(SKIPPED)


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
