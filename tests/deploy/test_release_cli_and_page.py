"""`streamflow deploy-server` and `streamflow release ...` end to end as commands, and the status page in a real
headless Chromium (Debian's package): the DOM holds the versions table, the screenshot the coverage chart."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from connectors.tunnel.keys import KeyRegistry
from streamflow.cli import main
from streamflow.deploy.device.client import DeployClient
from streamflow.deploy.release.build import build_bundle
from streamflow.deploy.release.status_page import COVERAGE_COLOUR, FAILURE_COLOUR
from streamflow.deploy.signing import public_key_path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Debian's chromium is not installed and could not be (`make test` installs it with apt-get: "
                    "apt-get install -y chromium)")
    return path


@pytest.fixture
def deploy_server(tmp_path, signing_key):
    port = _free_port()
    directory = tmp_path / "server"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    keys = KeyRegistry(tmp_path / "keys.json")
    for i in range(40):  # the fleet's devices, registered before the server starts (streamflow tunnel keys add)
        keys.add(f"phone-{i}")
    process = subprocess.Popen([sys.executable, "-m", "streamflow.cli", "deploy-server", "--trusted-key",
                                str(public_key_path(signing_key)), "--dir", str(directory), "--port", str(port),
                                "--key-registry", str(keys.path)],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"deploy-server did not start: {process.communicate()[0]}")
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}", directory, keys
    process.terminate()
    process.wait(20)


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


def test_release_commands_drive_the_server_and_the_page_shows_it_in_chromium(deploy_server, counter_repo,
                                                                             signing_key, tmp_path, capsys):
    base_url, directory, keys = deploy_server
    out = tmp_path / "bundles"
    bundles = {tag: build_bundle(counter_repo.path, tag, signing_key=signing_key, out=out) for tag in ("v1", "v2")}
    common = ["--server", base_url, "--token-file", str(directory / "admin.token")]
    assert main(["release", "publish", str(bundles["v1"]), *common]) == 0
    assert main(["release", "publish", str(bundles["v2"]), *common]) == 0
    assert "published counter@2" in capsys.readouterr().out
    assert main(["release", "start", "counter", "2", "--steps", "50,100", "--manual", "--min-samples", "1",
                 "--max-failure-rate", "0.5", "--rule", "os=android", *common]) == 0
    assert "counter@2 active, stage gray, gray 50%" in capsys.readouterr().out
    # the server refuses with a reason and exit code 2
    assert main(["release", "start", "counter", "2", *common]) == 2
    assert "already has a release in progress" in capsys.readouterr().err
    assert main(["release", "advance", "nosuchtask", *common]) == 2
    devices = [DeployClient(base_url, f"phone-{i}", keys.key_for(f"phone-{i}"),
                            attrs={"os": "android" if i % 4 else "ios"}) for i in range(40)]
    for device in devices:
        device.tasks = {"counter": "1"}
    failing = None
    for round_ in range(3):
        for device in devices:
            _, directives = device.request("/app/feed")
            for d in directives:
                device.tasks = {"counter": d["version"]}
        if round_ == 0:
            first_wave = [d for d in devices if d.tasks["counter"] == "2"]
            assert main(["release", "advance", "counter", *common]) == 0  # 50% -> 100%
        if round_ == 1:  # a device of the first wave (its cohort has samples now) fails, reports, goes back to v1
            failing = first_wave[0]
            failing.report("counter", "2", ok=False, reason="load_failed: counter@2: simulated")
            failing.tasks = {"counter": "1"}
        time.sleep(5.2)  # the server samples coverage every 5 s
    expected = {d.device_id: "2" if i % 4 and d is not failing else "1" for i, d in enumerate(devices)}
    assert {d.device_id: d.tasks["counter"] for d in devices} == expected
    assert main(["release", "status", *common]) == 0
    text = capsys.readouterr().out
    assert "counter: stable 1, release counter-2-1, 40 devices (1: 11, 2: 29)" in text
    assert "1 failed" in text
    # the status page in a real browser: DOM and screenshot
    chromium = _chromium()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chromium-profile'}", "--hide-scrollbars"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", f"{base_url}/deploy/status"], capture_output=True,
                         text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert '<table class="tasks">' in html and "<td>counter</td>" in html
    assert '<table class="releases">' in html and "counter@2" in html and '<span class="active">active</span>' in html
    assert '<table class="cohorts">' in html and "<td>0-50%</td>" in html
    png = tmp_path / "status.png"
    shot = subprocess.run([chromium, *flags, f"--screenshot={png}", "--window-size=1200,1400",
                           f"{base_url}/deploy/status"], capture_output=True, text=True, timeout=180)
    assert shot.returncode == 0 and png.is_file(), shot.stderr[-2000:]
    image = Image.open(png).convert("RGB")
    assert image.size == (1200, 1400)
    colours = image.getcolors(maxcolors=1 << 20)
    assert len(colours) > 20, "the screenshot is blank"
    by_colour = {rgb: n for n, rgb in colours}
    assert by_colour.get(_rgb(COVERAGE_COLOUR), 0) > 2000, "no coverage area in the screenshot"
    assert by_colour.get(_rgb(FAILURE_COLOUR), 0) > 50, "no failure-rate line in the screenshot"
    # roll back by command, blocking the digest
    assert main(["release", "rollback", "counter", "--reason", "operator", "--block", *common]) == 0
    assert "rolled_back" in capsys.readouterr().out
    on_v2 = next(d for d in devices if d.tasks["counter"] == "2")
    _, directives = on_v2.request("/app/feed")
    assert [(d["action"], d["version"]) for d in directives] == [("rollback", "1")]


def test_release_commands_without_a_server_exit_2_naming_how_to_start_one(tmp_path, capsys):
    token = tmp_path / "admin.token"
    token.write_text("t")
    assert main(["release", "status", "--server", f"http://127.0.0.1:{_free_port()}", "--token-file",
                 str(token)]) == 2
    assert "Connection refused): start one with `streamflow deploy-server" in capsys.readouterr().err
    assert main(["release", "status", "--token-file", str(tmp_path / "missing.token")]) == 2
    assert "admin token" in capsys.readouterr().err
