"""The code sandbox on crafted programs: each fails safely, for the right reason, in time."""

import ctypes
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from evals.grading.sandbox import Job, Sandbox, SandboxConfig, capabilities, live_processes_of

# The wall-clock limit of the shared sandbox: a trivial program must finish inside it even
# while another test worker loads the machine (at 1 s, a loaded run's start-up could reach it).
WALL = 3.0


ROOT = os.geteuid() == 0
# Without root there is no mount namespace, and the sandbox refuses to run programs unless told
# to accept a writable host filesystem; the fallback tests below need that permission.
FALLBACK_OK = {} if ROOT else {"require_fs_isolation": False}
needs_root = pytest.mark.skipif(not ROOT, reason="filesystem isolation needs root (mount namespace)")


@pytest.fixture(scope="module")
def sandbox():
    # This test process's own uid range: a run's uid is free again once the run ends, and under
    # two pytest workers a run of the other worker could take it before a test here checks that
    # nothing of its run still lives as that uid. One fresh-clone CI run found a live process of
    # the fork bomb's uid 0.2 s after its run; that race explains it.
    return Sandbox(SandboxConfig(wall_s=WALL, memory_mb=256, max_processes=16, max_file_mb=1, workers=2,
                                 uid_base=_private_uid_base(), **FALLBACK_OK))


def _run(sandbox, job):
    """One job. How long it took is not asserted (a loaded machine stretches any bound); that a
    program past its limit is stopped is: its status says timeout and none of its processes live."""
    return sandbox.run(job)


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


def test_memory_bomb():
    # Its own sandbox with the other memory tests' wall limit, so that the memory limit, not the
    # clock, is what a loaded machine's slow allocations reach first.
    sb = Sandbox(SandboxConfig(wall_s=15, memory_mb=256, max_processes=16, max_file_mb=1,
                               **FALLBACK_OK))
    r = _run(sb, Job(source="x = []\nwhile True:\n    x.append(bytearray(10**7))\n"))
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
    if not capabilities(sandbox.config).user_isolation:
        # (and RLIMIT_NPROC then counts every process of the user, the fork bomb's included)
        pytest.skip("no per-slot uid here: escaped children are only killed with uid isolation")
    src = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\nprint('parent done')\n"
    r = _run(sandbox, Job(source=src))
    assert r.status == "ok" and "parent done" in r.stdout
    assert live_processes_of(r.uid) == []


@needs_root
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


@needs_root
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
    assert len(visited) > 1000 and "/usr/lib" in visited
    # The minimal root holds no host state: no /run (sockets, locks), no project or data tree.
    hidden = ("/run", "/work", "/home", "/etc/passwd", os.path.dirname(os.path.abspath(__file__)))
    assert not [v for v in visited if v.startswith(hidden)], [v for v in visited if v.startswith(hidden)][:5]
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
    assert r.status == "runtime_error"
    assert "Read-only file system" in r.stderr or "No such file or directory" in r.stderr
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
    # Results come back in input order whatever order the workers finish in (the first job
    # sleeps longest); each program got its own uid while the others ran.
    jobs = [Job(source=f"import time\ntime.sleep({0.4 - 0.1 * i})\nprint({i})\n") for i in range(4)]
    results = sandbox.run_many(jobs)
    assert [r.stdout.strip() for r in results] == ["0", "1", "2", "3"]
    assert all(r.status == "ok" for r in results)
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


# ----------------------------------------------------------------------------------------
# Hostile programs against the isolation added on top: IPC, one memory bound, minimal root,
# uid locks, the status channel, TMPDIR, ptys and keyrings.
# ----------------------------------------------------------------------------------------

_MB = 1 << 20
# ctypes prelude for SysV / POSIX IPC inside programs (and in the test process itself).
_IPC = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmat.restype = ctypes.c_void_p
libc.shmdt.argtypes = [ctypes.c_void_p]
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
IPC_CREAT = 0o1000
"""


def _private_uid_base() -> int:
    """A uid range of this test process alone, for tests that need the same uid twice."""
    return 1_000_000 + (os.getpid() % 4096) * 8192


def _ipc_objects_of(key: int) -> dict[str, int]:
    ns: dict = {}
    exec(_IPC, ns)
    libc = ns["libc"]
    return {"shm": libc.shmget(key, 0, 0), "msg": libc.msgget(key, 0), "sem": libc.semget(key, 0, 0)}


@needs_root
def test_sysv_and_posix_ipc_neither_outlive_the_program_nor_see_the_host():
    sb = Sandbox(SandboxConfig(wall_s=10))
    key, host_key = 0x6B76_0000 + os.getpid() % 0x10000, 0x6B77_0000 + os.getpid() % 0x10000
    queue = f"/kvarena-test-{os.getpid()}".encode()
    ns: dict = {}
    exec(_IPC, ns)
    host_shm = ns["libc"].shmget(host_key, 4096, IPC_CREAT_RW)
    assert host_shm >= 0
    try:
        make = _IPC + (
            f"shm = libc.shmget({key}, 64 << 20, IPC_CREAT | 0o600)\n"
            "addr = libc.shmat(shm, None, 0)\n"
            "ctypes.memset(addr, 1, 64 << 20)\n"  # 64 MB really held
            "libc.shmdt(ctypes.c_void_p(addr))\n"
            f"print('made', shm >= 0, libc.msgget({key}, IPC_CREAT | 0o600) >= 0,\n"
            f"      libc.semget({key}, 1, IPC_CREAT | 0o600) >= 0,\n"
            f"      libc.mq_open({queue!r}, os.O_CREAT | os.O_RDWR, 0o600, None) >= 0)\n"
            f"print('host', libc.shmget({host_key}, 0, 0))\n"
        )
        r = sb.run(Job(source=make))
        assert r.status == "ok", (r.status, r.stderr[-1000:])
        assert r.stdout.splitlines() == ["made True True True True", "host -1"]
        look = _IPC + (
            f"print(libc.shmget({key}, 0, 0), libc.msgget({key}, 0), libc.semget({key}, 0, 0),\n"
            f"      libc.mq_open({queue!r}, os.O_RDONLY, 0, None))\n"
        )
        r = sb.run(Job(source=look))
        assert r.status == "ok" and r.stdout.split() == ["-1"] * 4, (r.stdout, r.stderr[-1000:])
        # Nor did anything reach the host's namespace.
        assert _ipc_objects_of(key) == {"shm": -1, "msg": -1, "sem": -1}
        assert ns["libc"].mq_open(queue, os.O_RDONLY, 0, None) == -1
        assert capabilities(sb.config).ipc_namespace
    finally:
        ns["libc"].shmctl(host_shm, 0, None)  # IPC_RMID


IPC_CREAT_RW = 0o1000 | 0o666


def _memory_config(backend: str, **kw) -> SandboxConfig:
    cfg = SandboxConfig(memory_cgroup=backend == "cgroup", **kw)
    bound = capabilities(cfg).memory_bound
    if backend == "cgroup" and bound == "per-process":
        pytest.skip("no writable memory cgroup here: memory_mb is a per-process bound "
                    f"({capabilities(cfg).notes})")
    assert (bound == "per-process") == (backend == "per-process"), bound
    return cfg


_FIVE_PROCESSES = """
import os, time
children = []
for _ in range(5):
    pid = os.fork()
    if pid == 0:
        block = b"\\x01" * (300 << 20)   # 300 MB, every page touched
        time.sleep(1.0)                # all five hold theirs at once
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
print("all five held 300 MB")
"""


@needs_root
def test_one_memory_bound_over_all_processes():
    cfg = _memory_config("cgroup", wall_s=15, memory_mb=1024, max_processes=16)
    assert capabilities(cfg).memory_total_mb == 1024
    r = Sandbox(cfg).run(Job(source=_FIVE_PROCESSES))
    # (The parent does not check its children, so it may still print: one was OOM-killed.)
    assert r.status == "memory" and "all the program's processes" in r.detail, (r.status, r.detail)


def test_per_process_bound_is_documented():
    cfg = SandboxConfig(memory_cgroup=False, memory_mb=256, max_processes=8, tmpfs_mb=16, **FALLBACK_OK)
    caps = capabilities(cfg)
    assert caps.memory_bound == "per-process"
    assert caps.memory_total_mb == 256 * (8 + 1) + 4 * 16
    assert any("no memory cgroup" in note for note in caps.notes)


@needs_root
@pytest.mark.parametrize("backend", ["cgroup", "per-process"])
def test_memfd_memory_is_bounded(backend):
    cfg = _memory_config(backend, wall_s=15, memory_mb=128)
    # 30 memfds of 10 MB each: every one stays under the file-size limit (which applies to
    # memfd writes too), together they hold 300 MB outside any process's address space.
    src = ("import os\nchunk = b'x' * (1 << 20)\nfds = [os.memfd_create(f'hoard{i}') for i in range(30)]\n"
           "for fd in fds:\n    for _ in range(10):\n        os.write(fd, chunk)\nprint('held 300 MB')\n")
    r = Sandbox(cfg).run(Job(source=src))
    assert "held" not in r.stdout
    if backend == "cgroup":  # counted against the program's one bound
        assert r.status == "memory", (r.status, r.detail, r.stderr[-500:])
    else:  # refused outright: no per-process limit would count it
        assert r.status == "runtime_error" and "PermissionError" in r.stderr, (r.status, r.stderr[-500:])


@needs_root
@pytest.mark.parametrize("backend", ["cgroup", "per-process"])
def test_sysv_shm_is_bounded(backend):
    # shmmax (memory_mb in the program's IPC namespace) refuses one huge segment; with
    # shm_rmid_forced a segment dies at its last detach, so shm is only ever held attached,
    # inside some process's address space and its cgroup, and many small ones are refused too.
    cfg = _memory_config(backend, wall_s=15, memory_mb=128)
    src = _IPC + (
        "print('one 300 MB segment:', libc.shmget(0, 300 << 20, IPC_CREAT | 0o600))\n"
        "for i in range(30):  # 30 segments of 10 MB, each kept attached and touched\n"
        "    shm = libc.shmget(0, 10 << 20, IPC_CREAT | 0o600)\n"
        "    addr = libc.shmat(shm, None, 0) if shm >= 0 else None\n"
        "    if addr in (None, ctypes.c_void_p(-1).value):\n"
        "        print('refused at', i)\n"
        "        break\n"
        "    ctypes.memset(addr, 1, 10 << 20)\n"
        "else:\n"
        "    print('held 300 MB')\n"
    )
    r = Sandbox(cfg).run(Job(source=src))
    assert "held" not in r.stdout and "one 300 MB segment: -1" in r.stdout, (r.status, r.stdout)
    assert r.status == "memory" or "refused at" in r.stdout, (r.status, r.stdout, r.stderr[-500:])


@needs_root
@pytest.mark.parametrize("as_root", [False, True], ids=["sandbox-uid", "root-without-capabilities"])
def test_host_files_are_invisible(as_root):
    # A world-readable "data file" outside /tmp, and the project tree: a program that looks
    # its answers up in either finds nothing, even as root (it is not there, not just denied).
    data_dir = tempfile.mkdtemp(dir="/var/tmp")
    try:
        os.chmod(data_dir, 0o755)
        data = os.path.join(data_dir, "test.jsonl")
        with open(data, "w") as f:
            f.write('{"output": "42"}\n')
        os.chmod(data, 0o644)
        probes = [data, os.path.abspath(__file__), os.path.dirname(os.path.abspath(__file__))]
        src = (f"import os\nfor p in {probes!r}:\n"
               "    try:\n        print(len(open(p).read()) if os.path.isfile(p) else os.listdir(p))\n"
               "    except OSError as e:\n        print(type(e).__name__)\n")
        r = Sandbox(SandboxConfig(wall_s=10, isolate_user=not as_root)).run(Job(source=src))
        assert r.status == "ok" and r.stdout.split() == ["FileNotFoundError"] * 3, (r.stdout, r.stderr)
    finally:
        shutil.rmtree(data_dir)



_HELPER = """
import os, subprocess, sys
probe = "import os, sys; print(os.path.exists(sys.argv[1]), os.getuid())"
print(subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True).stdout.strip())
print(subprocess.run([sys.executable, "-c", probe, HOST_FILE], capture_output=True, text=True).stdout.strip(),
      os.getuid())
"""

_SPAWN = """
import multiprocessing


def square(x):
    return x * x


if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        print(sum(pool.map(square, range(10))))
"""


@needs_root
@pytest.mark.parametrize("source, printed", [
    (_HELPER.replace("HOST_FILE", repr(os.path.abspath(__file__))), ["1", "False", "UID", "UID"]),
    (_SPAWN, ["285"]),
], ids=["helper-process", "multiprocessing-spawn"])
def test_a_program_can_start_the_interpreter_it_runs_on(source, printed):
    """``sys.executable`` names an interpreter inside the sandbox's root, so a correct program
    that starts it (a helper process, multiprocessing's spawn method) runs; what it starts is
    confined as the program is (no host file, the program's own uid)."""
    r = Sandbox(SandboxConfig(wall_s=20)).run(Job(source=source))
    assert r.status == "ok", (r.status, r.stdout, r.stderr[-2000:])
    assert r.stdout.split() == [str(r.uid) if p == "UID" else p for p in printed] and r.uid, r.stdout


@needs_root
def test_host_unix_socket_is_unreachable():
    where = tempfile.mkdtemp(dir="/var/tmp")
    os.chmod(where, 0o755)
    path = os.path.join(where, "listener.sock")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen(1)
        server.settimeout(0.2)
        src = (f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\n"
               "s.sendall(b'leak')\nprint('connected')\n")
        r = Sandbox(SandboxConfig(wall_s=10)).run(Job(source=src))
        assert r.status == "runtime_error" and "FileNotFoundError" in r.stderr, (r.status, r.stderr[-500:])
        with pytest.raises(OSError):
            server.accept()
    finally:
        server.close()
        shutil.rmtree(where)


@needs_root
def test_uids_skip_busy_ones_and_never_kill_a_host_process():
    base = _private_uid_base()
    # A host process that happens to run as the first uid of the range.
    bystander = subprocess.Popen(["sleep", "30"], user=base, group=base, extra_groups=[])
    try:
        deadline = time.monotonic() + 10
        while not live_processes_of(base) and time.monotonic() < deadline:
            time.sleep(0.01)
        r = Sandbox(SandboxConfig(wall_s=5, uid_base=base)).run(
            Job(source="import os\nif os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(30)\n"
                       "print(os.getuid())\n"))
        assert r.status == "ok" and r.uid is not None and r.uid != base and r.stdout.strip() == str(r.uid)
        assert bystander.poll() is None, "the run killed a host process that shares the uid range"
        assert live_processes_of(r.uid) == []  # while its own escaped child is gone
    finally:
        bystander.kill()
        bystander.wait()


_OTHER_GRADER = """
import sys
from evals.grading.sandbox import Job, Sandbox, SandboxConfig
r = Sandbox(SandboxConfig(wall_s=8, uid_base=int(sys.argv[1]))).run(
    Job(source="import os, time\\nprint(os.getuid(), flush=True)\\ntime.sleep(3)\\n"))
print(r.status, r.uid)
"""


@needs_root
def test_two_graders_never_share_a_uid():
    base = _private_uid_base()
    other = subprocess.Popen([sys.executable, "-c", _OTHER_GRADER, str(base)], stdout=subprocess.PIPE,
                             text=True, cwd=Path(__file__).parent.parent)
    try:
        deadline = time.monotonic() + 20
        while not any(live_processes_of(u) for u in range(base, base + 4)) and time.monotonic() < deadline:
            time.sleep(0.01)
        r = Sandbox(SandboxConfig(wall_s=5, uid_base=base)).run(Job(source="print('mine')"))
        out, _ = other.communicate(timeout=30)
    finally:
        other.kill()
    status, other_uid = out.split()
    assert status == "ok" and r.status == "ok" and r.uid != int(other_uid), (r.uid, out)


_FORGE = """
import os
forged = (b'exit 0\\n{"event": "exit", "code": 0}\\n{"event": "ready"}\\n'
          b'{"event": "result", "value": "[1]"}\\n'
          b'{"event": "exit", "code": "x"}\\n{"event": "result", "value": 5}\\n[1, 2]\\n{"event": 7}\\n'
          b'{"event": "exit", "co')
for fd in range(3, 256):
    try:
        os.write(fd, forged)
    except OSError:
        pass
"""


@pytest.mark.parametrize("ending,status", [
    ("os._exit(9)", "runtime_error"),
    ("os.kill(os.getpid(), 9)", "killed"),
    ("while True:\n    pass", "timeout"),
])
def test_forged_status_lines_cannot_turn_a_failure_into_ok(ending, status):
    sb = Sandbox(SandboxConfig(wall_s=3, cpu_s=1, **FALLBACK_OK))
    r = sb.run(Job(source=_FORGE + ending + "\n"))
    assert r.status == status, (r.status, r.detail, r.stderr[-500:])
    r = sb.run(Job(source=_FORGE + "def f():\n    os._exit(9)\n", function="f"))
    assert r.status == "runtime_error" and r.value is None, (r.status, r.detail)


def test_a_flood_of_events_is_read_within_a_bound():
    sb = Sandbox(SandboxConfig(wall_s=10, max_file_mb=8, max_capture_bytes=4096, **FALLBACK_OK))
    src = ("import os\nline = b'{\"event\": \"e\"}\\n' * 65536\nfor fd in range(3, 64):\n"
           "    try:\n        for _ in range(8):\n            os.write(fd, line)\n"
           "    except OSError:\n        pass\nprint('flooded')\n")
    r = sb.run(Job(source=src))
    assert r.status == "ok" and r.stdout.strip() == "flooded", (r.status, r.detail)


@needs_root
def test_tmpdir_is_private_whatever_the_host_tmpdir(monkeypatch):
    host_tmp = tempfile.mkdtemp(dir="/var/tmp")
    try:
        os.chmod(host_tmp, 0o755)
        monkeypatch.setenv("TMPDIR", host_tmp)
        monkeypatch.setattr(tempfile, "tempdir", host_tmp)  # the grader's own files go there
        src = (f"import os, tempfile\nprint(os.environ['TMPDIR'], tempfile.gettempdir())\n"
               "with tempfile.NamedTemporaryFile(delete=False) as f:\n    f.write(b'x')\n"
               f"print(os.path.exists({host_tmp!r}))\n")
        r = Sandbox(SandboxConfig(wall_s=10)).run(Job(source=src))
        assert r.status == "ok", (r.status, r.stderr[-500:])
        tmpdir, gettempdir, host_visible = r.stdout.split()
        assert tmpdir == gettempdir and tmpdir.startswith("/tmp/kvarena-sbx-") and host_visible == "False"
        assert os.listdir(host_tmp) == []  # its private directory is gone, nothing was written
    finally:
        shutil.rmtree(host_tmp)


@needs_root
def test_no_host_pty():
    src = ("import os\nprint(os.path.exists('/dev/ptmx'), os.path.exists('/dev/pts'))\n"
           "try:\n    os.openpty()\n    print('pty')\nexcept OSError as e:\n    print(type(e).__name__)\n")
    r = Sandbox(SandboxConfig(wall_s=10)).run(Job(source=src))
    assert r.status == "ok" and r.stdout.split() == ["False", "False", "FileNotFoundError"], r.stdout


_KEYS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl


def _keyring_program(action: str) -> str:
    add_key, keyctl = _KEYS[platform.machine()]
    return f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
def add(ring):
    return libc.syscall(L({add_key}), b"user", b"kvarena-test", b"secret", L(6), L(ring))
def find(ring):
    return libc.syscall(L({keyctl}), L(10), L(ring), b"user", b"kvarena-test", L(0))  # KEYCTL_SEARCH
session = libc.syscall(L({keyctl}), L(0), L(-3), L(0))  # KEYCTL_GET_KEYRING_ID of @s
if {action == "add"!r}:
    print(session, add(-3) > 0, add(-4) > 0)  # session and user keyrings
else:
    print(session, find(-3), find(-4))
"""


@needs_root
def test_keyrings_are_fresh():
    if platform.machine() not in _KEYS:
        pytest.skip(f"no keyctl syscall numbers for {platform.machine()} in this test")
    sb = Sandbox(SandboxConfig(wall_s=10, uid_base=_private_uid_base()))
    first = sb.run(Job(source=_keyring_program("add")))
    second = sb.run(Job(source=_keyring_program("find")))
    assert first.status == "ok" and second.status == "ok", (first.stderr, second.stderr)
    assert first.uid == second.uid  # the same user: only the sandbox stands between the runs
    session1, *added = first.stdout.split()
    session2, *found = second.stdout.split()
    assert added == ["True", "True"] and found == ["-1", "-1"], (first.stdout, second.stdout)
    ns: dict = {}
    exec(_IPC, ns)
    host_session = ns["libc"].syscall(ctypes.c_long(_KEYS[platform.machine()][1]), ctypes.c_long(0),
                                      ctypes.c_long(-3), ctypes.c_long(0))
    assert len({int(session1), int(session2), host_session}) == 3


def _fake_cgroup_tree(tmp_path, monkeypatch, version: int, alone: bool):
    """A plain directory laid out like a cgroup hierarchy, for the file protocol of a backend
    this machine may not have (the kernel's side is what the root-only tests above exercise)."""
    from evals.grading import sandbox_cgroup

    root = tmp_path / "cgroup"
    grader = root / "grader"
    grader.mkdir(parents=True)
    (grader / "cgroup.procs").write_text(f"{os.getpid()}\n" if alone else "1\n2\n")
    if version == 2:
        (grader / "cgroup.controllers").write_text("cpu memory pids\n")
        (grader / "cgroup.subtree_control").write_text("")
        mounts, own = [(str(root), "cgroup2", {"rw"})], {"": "/grader"}
    else:
        mounts = [(str(root), "cgroup", {"rw", "memory", "pids"})]
        own = {"memory": "/grader", "pids": "/grader"}
    monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: mounts)
    monkeypatch.setattr(sandbox_cgroup, "_own_cgroups", lambda: own)
    return sandbox_cgroup, grader


@pytest.mark.parametrize("alone", [False, True], ids=["shared-cgroup", "alone-in-cgroup"])
def test_cgroup_v2_protocol(tmp_path, monkeypatch, alone):
    cg, grader = _fake_cgroup_tree(tmp_path, monkeypatch, 2, alone)
    backend = cg._V2.find()
    assert backend is not None and backend.base == str(grader)
    assert (grader / "cgroup.subtree_control").read_text() == "+memory +pids"
    # Alone in its cgroup, the grader moves into a leaf first ("no internal processes").
    leaf = grader / "kvarena-grader" / "cgroup.procs"
    assert (leaf.read_text() == str(os.getpid())) if alone else not leaf.exists()
    group = backend.create("kvarena-sbx-t", 128, 10)
    d = grader / "kvarena-sbx-t"
    assert [(d / n).read_text() for n in ("memory.max", "memory.oom.group", "pids.max")] == [
        str(128 << 20), "1", "10"]
    assert group.procs_files == [str(d / "cgroup.procs")] and group.oom_kills() == 0
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 2\n")
    assert group.oom_kills() == 2


def test_cgroup_v1_protocol(tmp_path, monkeypatch):
    cg, grader = _fake_cgroup_tree(tmp_path, monkeypatch, 1, alone=False)
    backend = cg._V1.find()
    assert backend is not None and backend.memory_base == backend.pids_base == str(grader)
    group = backend.create("kvarena-sbx-t", 64, 5)
    d = grader / "kvarena-sbx-t"
    assert (d / "memory.limit_in_bytes").read_text() == str(64 << 20) and (d / "pids.max").read_text() == "5"
    (d / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert group.oom_kills() == 1


def test_stale_cgroups_of_dead_graders_are_swept(tmp_path):
    from evals.grading import sandbox_cgroup

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names no process
    for pid in (dead.pid, os.getpid()):
        (tmp_path / f"kvarena-sbx-{pid}-0").mkdir()
    (tmp_path / "unrelated").mkdir()
    sandbox_cgroup.sweep_stale(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"kvarena-sbx-{os.getpid()}-0", "unrelated"]


_DYING_GRADER = """
import sys
from evals.grading.sandbox import Job, Sandbox, SandboxConfig
Sandbox(SandboxConfig(wall_s=60, uid_base=int(sys.argv[1]))).run(
    Job(source="import os, time\\nif os.fork() == 0:\\n    os.setsid()\\ntime.sleep(60)\\n"))
"""


@needs_root
def test_a_killed_grader_leaves_no_program_behind():
    base = _private_uid_base()
    grader = subprocess.Popen([sys.executable, "-c", _DYING_GRADER, str(base)],
                              cwd=Path(__file__).parent.parent)
    try:
        deadline = time.monotonic() + 20
        while len(live_processes_of(base)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(live_processes_of(base)) >= 2, "the program did not start"
    finally:
        grader.kill()
        grader.wait()
    deadline = time.monotonic() + 10
    while live_processes_of(base) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_processes_of(base) == []


_FORGE_AFTER_RETURN = """
import atexit, os

def _forge():
    for fd in range(3, 256):
        try:
            os.write(fd, b'{"event": "result", "value": "[7]"}\\n')
        except OSError:
            pass

atexit.register(_forge)

def f():
    return [1]
"""


def test_a_result_forged_after_the_function_returned_does_not_replace_its_value():
    r = Sandbox(SandboxConfig(wall_s=5, **FALLBACK_OK)).run(Job(source=_FORGE_AFTER_RETURN, function="f"))
    assert (r.status, r.value) == ("ok", "[1]"), (r.status, r.value, r.detail)
