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


ROOT = os.geteuid() == 0
# Without root there is no mount namespace, and the sandbox refuses to run programs unless told
# to accept a writable host filesystem; the fallback tests below need that permission.
FALLBACK_OK = {} if ROOT else {"require_fs_isolation": False}
needs_root = pytest.mark.skipif(not ROOT, reason="filesystem isolation needs root (mount namespace)")


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxConfig(wall_s=WALL, memory_mb=256, max_processes=16, max_file_mb=1, workers=2,
                                 **FALLBACK_OK))


def _run(sandbox, job):
    t0 = time.monotonic()
    result = sandbox.run(job)
    elapsed = time.monotonic() - t0
    assert elapsed < BOUND, f"{result.status} took {elapsed:.1f}s"
    return result


def test_capabilities_are_probed():
    caps = capabilities(SandboxConfig(wall_s=WALL, **FALLBACK_OK))
    assert os.path.exists(caps.python)
    if os.geteuid() == 0:
        # As root every layer should be available on this machine (namespaces + own uid).
        assert (caps.user_isolation and caps.net_namespace and caps.private_tmp
                and caps.pid_namespace), caps.notes


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
    assert r.status == "runtime_error"
    assert any(e in r.stderr for e in ("PermissionError", "FileNotFoundError", "Read-only file system"))
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


# Walks the whole tree (but /proc and /sys, where no file can be created anyway) and tries
# to create a file in every directory; prints every directory it visited and where it wrote.
_WALKER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
print("remount-rw", libc.mount(None, b"/", None, 32 | 4096, None))  # MS_REMOUNT | MS_BIND
for top in ("/proc", "/sys"):
    try:
        open(os.path.join(top, MARK), "w").close()
        print("wrote", top)
    except OSError:
        pass
for root, dirs, files in os.walk("/"):
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys")]
    print("visited", root)
    try:
        with open(os.path.join(root, MARK), "w") as f:
            f.write("x")
        print("wrote", root)
    except OSError:
        pass
"""


@needs_root
@pytest.mark.parametrize("as_root", [False, True], ids=["sandbox-uid", "root-without-capabilities"])
def test_no_host_directory_is_writable(tmp_path, as_root):
    # As root (isolate_user=False, capabilities dropped) file permissions would allow writes
    # nearly everywhere, so only the read-only mount tree stands in the way.
    sb = Sandbox(SandboxConfig(wall_s=30, max_file_mb=16, max_capture_bytes=16 << 20,
                               isolate_user=not as_root))
    mark = f"kvarena-escape-{os.getpid()}-{int(as_root)}"
    r = sb.run(Job(source=f"MARK = {mark!r}\n" + _WALKER))
    assert r.status == "ok", (r.status, r.detail, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert lines[0] == "remount-rw -1", lines[0]
    visited = [line[len("visited "):] for line in lines if line.startswith("visited ")]
    wrote = {line[len("wrote "):] for line in lines if line.startswith("wrote ")}
    assert len(visited) > 1000 and "/usr/lib" in visited and "/run/lock" in visited
    workdir = next(line for line in visited
                   if line.endswith("/work") and line.startswith("/tmp/kvarena-sbx-"))
    private = ("/tmp", "/var/tmp", "/dev/shm", workdir)  # the sandbox's own tmpfs mounts
    assert all(d in private or d.startswith(tuple(p + "/" for p in private)) for d in wrote), sorted(wrote)
    left = [d for d in visited + ["/proc", "/sys"] if os.path.lexists(os.path.join(d, mark))]
    assert left == [], f"files left on the host: {left[:10]}"


@needs_root
def test_reported_escape_through_run_lock_is_closed():
    target = f"/run/lock/kvarena-{os.getpid()}"
    r = Sandbox(SandboxConfig()).run(Job(source=f"open({target!r}, 'w').write('e'); print(42)"))
    assert r.status == "runtime_error" and "Read-only file system" in r.stderr
    assert not os.path.exists(target)


@needs_root
def test_disk_use_is_bounded_and_freed():
    sb = Sandbox(SandboxConfig(wall_s=10, tmpfs_mb=8, max_file_mb=4))
    src = (
        "import os\n"
        "total = 0\n"
        "for d in ('/tmp', '/var/tmp', '/dev/shm', '.'):\n"
        "    for i in range(100):\n"
        "        try:\n"
        "            with open(os.path.join(d, f'fill{i}'), 'wb') as f:\n"
        "                for _ in range(8):\n"
        "                    f.write(b'x' * (1 << 20)); f.flush(); total += 1 << 20\n"
        "        except OSError:\n"
        "            break\n"
        "print(total)\n"
    )
    before = os.statvfs("/").f_bavail
    r = sb.run(Job(source=src))
    assert r.status == "ok", (r.status, r.stderr[-500:])
    assert int(r.stdout) <= 4 * 8 << 20  # four private tmpfs mounts of 8 MB each
    assert not os.path.exists("/tmp/fill0") and not os.path.exists("/var/tmp/fill0")
    assert abs(os.statvfs("/").f_bavail - before) * os.statvfs("/").f_frsize < 16 << 20


def test_without_mount_namespace_it_refuses_to_run():
    cfg = SandboxConfig(wall_s=WALL, namespaces=False)
    with pytest.raises(RuntimeError, match="require_fs_isolation=False"):
        capabilities(cfg)


def test_deep_recursion_is_a_quick_runtime_error():
    sb = Sandbox(SandboxConfig(wall_s=6, **FALLBACK_OK))
    src = "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return 1 + f(n + 1)\nprint(f(0))\n"
    r = sb.run(Job(source=src))
    assert r.status == "runtime_error" and "RecursionError" in r.detail, (r.status, r.detail)
    assert "frames in the middle omitted" in r.stderr and len(r.stderr) < 20_000
    # A legitimately deep recursion within the cap still works.
    src = ("import sys\nsys.setrecursionlimit(10**6)\n"
           "def f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\nprint(f(200000))\n")
    r = sb.run(Job(source=src))
    assert r.status == "ok" and r.stdout.strip() == "200000"


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

    src = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
           "s.sendall(b'leak')\n")
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
    sb = Sandbox(SandboxConfig(wall_s=WALL, memory_mb=256, namespaces=False, require_fs_isolation=False))
    assert not capabilities(sb.config).net_namespace
    r = _run(sb, Job(source="import socket\nsocket.socket()\n"))
    assert r.status == "runtime_error" and "network access is disabled" in r.stderr
    r = _run(sb, Job(source="import socket\nsocket.create_connection(('127.0.0.1', 9))\n"))
    assert r.status == "runtime_error" and "PermissionError" in r.stderr


def test_without_user_isolation_runs_as_current_user():
    sb = Sandbox(SandboxConfig(wall_s=WALL, memory_mb=256, isolate_user=False, **FALLBACK_OK))
    assert not capabilities(sb.config).user_isolation
    r = _run(sb, Job(source="import os\nprint(os.getuid())\n"))
    assert r.status == "ok" and r.uid is None and r.stdout.strip() == str(os.getuid())
