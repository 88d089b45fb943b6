"""The code sandbox on crafted programs: each fails safely, for the right reason, in time."""

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from evals.sandbox import Job, Sandbox, SandboxConfig, capabilities, live_processes_of

WALL = 1.0
# A failing program must end within its wall limit plus harness start-up and clean-up.
BOUND = WALL + SandboxConfig().startup_s + 1.5


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxConfig(wall_s=WALL, memory_mb=256, max_processes=16, max_file_mb=1, workers=2))


def _run(sandbox, job):
    t0 = time.monotonic()
    result = sandbox.run(job)
    elapsed = time.monotonic() - t0
    assert elapsed < BOUND, f"{result.status} took {elapsed:.1f}s"
    return result


def test_capabilities_are_probed():
    caps = capabilities(SandboxConfig(wall_s=WALL))
    assert os.path.exists(caps.python)
    if os.geteuid() == 0:
        # As root every layer should be available on this machine (namespaces + own uid).
        assert caps.user_isolation and caps.net_namespace and caps.private_tmp and caps.pid_namespace, caps.notes


def test_correct_program(sandbox):
    r = _run(sandbox, Job(source="a, b = map(int, input().split())\nprint(a + b)\n", stdin="2 40\n"))
    assert r.status == "ok" and r.stdout == "42\n" and r.returncode == 0


def test_wrong_output_is_still_ok_status(sandbox):
    r = _run(sandbox, Job(source="print(41)\n"))
    assert r.status == "ok" and r.stdout.strip() == "41"  # judging the output is the grader's job


def test_exception_is_runtime_error(sandbox):
    r = _run(sandbox, Job(source="raise ValueError('boom')\n"))
    assert r.status == "runtime_error"
    assert "ValueError: boom" in r.stderr and "ValueError" in r.detail


def test_syntax_error_is_compile_error(sandbox):
    r = _run(sandbox, Job(source="def f(:\n    pass\n"))
    assert r.status == "compile_error" and "SyntaxError" in r.detail


def test_infinite_loop_times_out(sandbox):
    r = _run(sandbox, Job(source="while True:\n    pass\n"))
    assert r.status == "timeout"


def test_sleeping_program_hits_wall_clock(sandbox):
    r = _run(sandbox, Job(source="import time\ntime.sleep(60)\n"))
    assert r.status == "timeout" and r.detail == "wall-clock limit"


def test_memory_bomb(sandbox):
    r = _run(sandbox, Job(source="x = []\nwhile True:\n    x.append(bytearray(10**7))\n"))
    assert r.status == "memory"


def test_fork_bomb_is_contained(sandbox):
    src = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = _run(sandbox, Job(source=src))
    assert r.status in ("timeout", "runtime_error"), r
    if r.uid is not None:
        time.sleep(0.2)
        assert live_processes_of(r.uid) == [], "fork-bomb processes survived the run"
    # The test process can still create processes.
    assert subprocess.run(["true"]).returncode == 0


def test_escaped_child_is_killed(sandbox):
    # A child that leaves the process group (setsid) must not outlive the run.
    src = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\nprint('parent done')\n"
    r = _run(sandbox, Job(source=src))
    assert r.status == "ok" and "parent done" in r.stdout
    if r.uid is None:
        pytest.skip("no per-slot uid here: escaped children are only killed with uid isolation")
    assert live_processes_of(r.uid) == []


@pytest.mark.parametrize("where", ["tmp", "project"])
def test_writing_outside_its_directory_fails(sandbox, tmp_path, where):
    base = tmp_path if where == "tmp" else Path(__file__).parent
    target = base / f"escaped-{os.getpid()}.txt"
    src = f"open({str(target)!r}, 'w').write('x')\nprint('wrote')\n"
    r = _run(sandbox, Job(source=src))
    assert r.status == "runtime_error" and ("PermissionError" in r.stderr or "FileNotFoundError" in r.stderr)
    assert not target.exists()
    # Writing inside its own directory works.
    r = _run(sandbox, Job(source="open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())\n"))
    assert r.status == "ok" and r.stdout.strip() == "fine"


def test_private_tmp(sandbox):
    name = f"kvarena-sbx-test-{os.getpid()}.txt"
    r = _run(sandbox, Job(source=f"open('/tmp/{name}', 'w').write('x')\nprint('ok')\n"))
    if capabilities(sandbox.config).private_tmp:
        assert r.status == "ok"
    assert not os.path.exists(f"/tmp/{name}")


def test_huge_output_hits_file_size_limit(sandbox):
    r = _run(sandbox, Job(source="while True:\n    print('x' * 1000)\n"))
    assert r.status == "output_limit"


def test_network_is_unreachable(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.1)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    src = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'leak')\n"
    r = _run(sandbox, Job(source=src))
    accept()
    server.close()
    assert r.status == "runtime_error" and ("OSError" in r.stderr or "PermissionError" in r.stderr)
    assert accepted == []
    # The test process's own networking is unharmed.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))


def test_parent_environment_is_hidden(sandbox, monkeypatch):
    monkeypatch.setenv("KVARENA_TEST_SECRET", "s3cr3t-value")
    src = (
        "import os\n"
        "print('env:', 'KVARENA_TEST_SECRET' in os.environ, sorted(os.environ))\n"
        "try:\n"
        "    print('proc:', 's3cr3t-value' in open(f'/proc/{os.getppid()}/environ').read())\n"
        "except OSError as e:\n"
        "    print('proc: denied', type(e).__name__)\n"
    )
    r = _run(sandbox, Job(source=src))
    assert r.status == "ok"
    assert "env: False" in r.stdout and "s3cr3t" not in r.stdout
    if r.uid is not None:
        assert "proc: denied" in r.stdout
    assert os.environ["KVARENA_TEST_SECRET"] == "s3cr3t-value"


def test_signal_kill_is_reported(sandbox):
    r = _run(sandbox, Job(source="import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"))
    assert r.status == "killed"


def test_function_job(sandbox):
    src = "class Solution:\n    def pair(self, a, b):\n        return (a + b, [a, b])\n"
    r = _run(sandbox, Job(source=src, function="pair", args=(2, 3)))
    assert r.status == "ok" and r.value == "[5, [2, 3]]"
    r = _run(sandbox, Job(source="def f(x):\n    return {1, 2}\n", function="f", args=(1,)))
    assert r.status == "ok" and r.value is None and "JSON" in r.detail
    r = _run(sandbox, Job(source="def g():\n    return 1\n", function="missing", args=()))
    assert r.status == "runtime_error"


def test_run_many_parallel_and_ordered(sandbox):
    jobs = [Job(source=f"import time\ntime.sleep(0.5)\nprint({i})\n") for i in range(4)]
    t0 = time.monotonic()
    results = sandbox.run_many(jobs)
    elapsed = time.monotonic() - t0
    assert [r.stdout.strip() for r in results] == ["0", "1", "2", "3"]
    assert all(r.status == "ok" for r in results)
    assert elapsed < 2.2  # two at a time (one after another would take over 2.4 s)
    assert threading.active_count() < 20


def test_config_validation():
    with pytest.raises(ValueError, match="wall_s"):
        SandboxConfig(wall_s=0)
    with pytest.raises(ValueError, match="unknown sandbox option"):
        SandboxConfig.from_dict({"wall_seconds": 1})


def test_socket_guard_without_network_namespace():
    sb = Sandbox(SandboxConfig(wall_s=WALL, memory_mb=256, namespaces=False))
    assert not capabilities(sb.config).net_namespace
    r = _run(sb, Job(source="import socket\nsocket.socket()\n"))
    assert r.status == "runtime_error" and "network access is disabled" in r.stderr
    r = _run(sb, Job(source="import socket\nsocket.create_connection(('127.0.0.1', 9))\n"))
    assert r.status == "runtime_error" and "PermissionError" in r.stderr


def test_without_user_isolation_runs_as_current_user():
    sb = Sandbox(SandboxConfig(wall_s=WALL, memory_mb=256, isolate_user=False))
    assert not capabilities(sb.config).user_isolation
    r = _run(sb, Job(source="import os\nprint(os.getuid())\n"))
    assert r.status == "ok" and r.uid is None and r.stdout.strip() == str(os.getuid())
