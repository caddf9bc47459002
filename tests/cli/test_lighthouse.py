"""``python -m lowband.lighthouse``: starts torchft's Lighthouse, prints the URL groups connect to, answers
there, stops on SIGTERM with exit 0; bad input and a taken port are one line and exit 2."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lowband.lighthouse import connect_url, main

ROOT = Path(__file__).resolve().parents[2]
START_S = 120  # a loaded machine: importing torch alone can take tens of seconds


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lowband.lighthouse", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "RUST_LOG": "warn"})


def test_serves_at_the_printed_url_and_stops_on_sigterm() -> None:
    proc = _start("--min-replicas", "2", "--bind", "127.0.0.1:0")
    try:
        first = proc.stdout.readline()  # blocks until the server is up (or the process ended)
        assert first.startswith("lowband.lighthouse: listening on http://127.0.0.1:"), \
            (first, proc.stderr.read() if proc.poll() is not None else "")
        url = first.split("listening on ", 1)[1].split(" ", 1)[0]
        assert int(url.rsplit(":", 1)[1]) > 0 and "min_replicas 2" in first
        assert proc.stdout.readline().strip().endswith(f"TORCHFT_LIGHTHOUSE={url}")
        deadline = time.monotonic() + START_S
        while True:  # the dashboard answers on the same port
            try:
                with urllib.request.urlopen(url + "/", timeout=10) as resp:
                    assert resp.status == 200
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _err = proc.communicate(timeout=START_S)
        assert proc.returncode == 0 and out.strip().endswith("stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_taken_port_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _start("--min-replicas", "1", "--bind", f"127.0.0.1:{port}")
        out, err = proc.communicate(timeout=START_S)
    lines = [ln for ln in err.splitlines() if ln.startswith("lowband.lighthouse")]
    assert proc.returncode == 2 and not out
    assert lines == [f"lowband.lighthouse: error: cannot listen on '127.0.0.1:{port}': "
                     "Address already in use (os error 98)"], err


@pytest.mark.parametrize(("argv", "message"), [
    (["--min-replicas", "0"], "--min-replicas must be >= 1, got 0"),
    (["--min-replicas", "2", "--heartbeat-timeout-ms", "0"], "--heartbeat-timeout-ms must be >= 1, got 0"),
    (["--min-replicas", "2", "--bind", "nonsense"], "cannot listen on 'nonsense': invalid socket address"),
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lowband.lighthouse: error: {message}"


def test_missing_torchft_names_the_extra(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "torchft._torchft", None)  # import fails as if torchft were absent
    assert main(["--min-replicas", "1"]) == 2
    assert "install lowband's ft extra (pip install 'lowband[ft]', torchft==0.2.0)" in capsys.readouterr().err


@pytest.mark.parametrize(("bind", "advertised", "url"), [
    ("127.0.0.1:0", "http://vm:41234", "http://127.0.0.1:41234"),
    ("0.0.0.0:29510", "http://vm:29510", "http://vm:29510"),
    ("[::]:0", "http://node7:5000", "http://node7:5000"),
    ("10.77.0.1:29510", "http://vm:29510", "http://10.77.0.1:29510"),
    ("[fe80::1]:29510", "http://vm:29510", "http://[fe80::1]:29510"),
])
def test_connect_url_uses_the_bound_host_and_the_real_port(bind: str, advertised: str, url: str) -> None:
    assert connect_url(bind, advertised) == url
