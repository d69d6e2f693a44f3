"""Warm starts (ftkit/runtime/warm): a worker forked from the zygote behaves as a cold one would.

Real processes throughout: one zygote for the module, real clients started as
torchrun starts them (``python -u .../client.py SCRIPT ARGS``), real signals.
The drills (tests/drills/test_drill*.py) run every fault kind through warm workers under
torchrun, and tests/drills/test_unmodified_trainer.py runs ``ftkit run`` (warm by default)
with its startup watch ending a stuck warm group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ftkit.runtime.warm import client as wire
from ftkit.runtime.warm import zygote

SCRIPT = """
import json, os, random, signal, sys, time
preloaded = "torch" in sys.modules  # before this script imports anything heavy
from ftkit.coord import boot
out = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "report"
if mode == "report":
    doc = {
        "argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "path0": sys.path[0],
        "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "preloaded": preloaded,
        "env": os.environ.get("WARM_TEST_VALUE"), "random": random.random(),
        "stdin": sys.stdin.readline().strip(), "boot": boot.marks(),
        "launcher": os.environ.get("FTKIT_LAUNCHER_PID"),
        "extra": __import__("warm_extra").VALUE if os.environ.get("PYTHONPATH") else None,
    }
    with open(out, "w") as f:
        json.dump(doc, f)
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(int(os.environ.get("WARM_TEST_EXIT", "0")))
if mode == "wait-for-term":
    def on_term(signum, frame):
        with open(out, "w") as f:
            f.write("terminated")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    with open(out + ".pid", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
    sys.exit(5)
if mode == "sleep":
    with open(out + ".pid", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def zyg():
    z = zygote.start()
    yield z
    with open(os.path.join(z.directory, "replaceable-1"), "w"):  # a killed client's mark, left behind
        pass
    z.stop()
    assert z.proc.returncode == 0 and not os.path.exists(z.directory)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job" / "script.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def client(zyg, *argv, env=None, **kw):
    full = {**os.environ, **(zyg.env() if zyg else {}), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-u", zygote.client_path(), *map(str, argv)],
        env=full,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def wait_for(path, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.path.exists(path) and os.path.getsize(path):
            return open(path).read()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def state(pid: int) -> str:
    """Its state letter in /proc (R, S, T, Z...); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def alive(pid: int) -> bool:
    return state(pid) not in ("", "Z")


def test_a_warm_worker_runs_the_script_as_a_cold_one_would(zyg, script, tmp_path):
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    # A directory only the clients' PYTHONPATH names (the zygote started without it)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "warm_extra.py").write_text("VALUE = 'from PYTHONPATH'\n")
    env = {"PYTHONPATH": str(tmp_path / "lib")}
    procs = [
        client(zyg, script, o, env={**env, "WARM_TEST_VALUE": f"v{i}", "WARM_TEST_EXIT": str(3 + i)}, cwd=tmp_path)
        for i, o in enumerate(outs)
    ]
    results = [p.communicate(input=f"line {i}\n", timeout=60) for i, p in enumerate(procs)]
    docs = [json.loads(o.read_text()) for o in outs]
    for i, (p, (stdout, stderr), doc) in enumerate(zip(procs, results, docs)):
        # Its exit code, arguments, environment, directory and streams are the client's.
        assert p.returncode == 3 + i, stderr
        assert doc["argv"] == [str(script), str(outs[i])] and doc["name"] == "__main__"
        assert doc["path0"] == str(script.parent) and doc["cwd"] == str(tmp_path)
        assert doc["env"] == f"v{i}" and doc["stdin"] == f"line {i}" and doc["extra"] == "from PYTHONPATH"
        assert "to stdout" in stdout and "to stderr" in stderr and "cold" not in stderr
        # ... but it was forked from the zygote, with torch imported, in a session of its own
        assert doc["preloaded"] and doc["ppid"] == zyg.proc.pid and doc["pgid"] == doc["pid"]
        assert doc["launcher"] == str(p.pid) and doc["pid"] != p.pid
        assert doc["boot"]["process"] <= doc["boot"]["forked"] <= doc["boot"]["launch"]
    assert docs[0]["random"] != docs[1]["random"]  # each its own seed


def test_signals_pass_through_and_deaths_pass_back(zyg, script, tmp_path):
    # torchrun's SIGTERM to the client reaches the worker, which handles it (a preemption save)
    out = tmp_path / "term"
    p = client(zyg, script, out, "wait-for-term")
    worker = int(wait_for(str(out) + ".pid"))
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0 and out.read_text() == "terminated"
    # a SIGKILLed worker: its client dies of SIGKILL too (torchrun sees exit code -9)
    out = tmp_path / "kill"
    p = client(zyg, script, out, "sleep")
    worker = int(wait_for(str(out) + ".pid"))
    os.kill(worker, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    # a stopped worker cannot act on torchrun's SIGTERM (torchrun would wait 30 s, then SIGKILL):
    # its client ends it at once, and dies of the SIGKILL (the worker would sleep 60 s if continued)
    out = tmp_path / "stopped"
    p = client(zyg, script, out, "wait-for-term")
    worker = int(wait_for(str(out) + ".pid"))
    os.kill(worker, signal.SIGSTOP)
    while state(worker) != "T":
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == -signal.SIGKILL and not out.exists()
    # a SIGKILLed client (torchrun's last resort): the zygote kills its worker, even a stopped one
    out = tmp_path / "orphan"
    p = client(zyg, script, out, "sleep")
    worker = int(wait_for(str(out) + ".pid"))
    os.kill(worker, signal.SIGSTOP)
    p.kill()
    p.wait(timeout=30)
    end = time.monotonic() + 10
    while alive(worker) and time.monotonic() < end:
        time.sleep(0.02)
    assert not alive(worker)


def test_a_bad_request_is_refused_and_the_zygote_serves_on(zyg, script, tmp_path):
    for junk in (b"\x00\x00\x00\x05hello", b"\xff\xff\xff\xff", b"\x00\x00\x00\x02{}"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(zyg.socket_path)
            s.sendall(junk)
            s.settimeout(10)
            assert s.recv(1) == b""  # closed on us, nothing forked
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # well formed, but no streams passed
        s.connect(zyg.socket_path)
        wire.send_message(s, {"argv": ["x.py"], "env": {}, "cwd": "/"})
        s.settimeout(10)
        assert s.recv(1) == b""
    out = tmp_path / "after.json"
    p = client(zyg, script, out)
    p.communicate(input="ok\n", timeout=60)
    assert p.returncode == 0 and json.loads(out.read_text())["stdin"] == "ok"


def test_without_a_zygote_the_worker_starts_cold(script, tmp_path):
    out = tmp_path / "cold.json"
    p = client(None, script, out, env={wire.ZYGOTE_ENV: str(tmp_path / "no-such.sock"), "WARM_TEST_EXIT": "4"})
    _, stderr = p.communicate(input="cold\n", timeout=120)
    doc = json.loads(out.read_text())
    assert p.returncode == 4 and "starting the worker cold" in stderr
    assert doc["pid"] == p.pid and doc["ppid"] == os.getpid() and "forked" not in doc["boot"]
    assert doc["stdin"] == "cold"


def test_a_worker_is_replaced_only_when_killed_inside_an_in_process_loop_and_not_ending(tmp_path):
    """The client's rule (ftkit run --replace-dead): SIGKILL, the loop's mark present, no ending
    signal from torchrun, replacements left. Anything else is passed on to torchrun as before."""
    import signal as sig

    from ftkit.runtime.warm.client import _replaceable

    mark = tmp_path / "replaceable-1"
    mark.touch()
    killed = {"signal": int(sig.SIGKILL)}
    assert _replaceable(killed, False, 0, 1, str(mark))
    assert not _replaceable(killed, True, 0, 1, str(mark))  # torchrun is ending the group
    assert not _replaceable(killed, False, 1, 1, str(mark))  # no replacement left
    assert not _replaceable({"signal": int(sig.SIGTERM)}, False, 0, 1, str(mark))
    assert not _replaceable({"exit": 75}, False, 0, 1, str(mark))  # gave up: torchrun restarts
    mark.unlink()
    assert not _replaceable(killed, False, 0, 1, str(mark))  # not inside run_in_process


def test_the_warm_agents_method_name_names_the_frame_torchs_does():
    # ftkit/runtime/warm/agent.py replaces the dynamic rendezvous's get_method_name (inspect.stack(), slow
    # in an interpreter with a zygote's modules) for a warm torchrun agent: same frame, same name.
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import get_method_name

    from ftkit.runtime.warm.agent import method_name

    def record(name_of):  # as the rendezvous's _record calls it: the name of its own caller
        return name_of()

    def next_rendezvous(name_of):
        return record(name_of)

    assert next_rendezvous(get_method_name) == next_rendezvous(method_name) == "next_rendezvous"
    assert get_method_name(depth=500) == method_name(depth=500) == "no_method_name"
