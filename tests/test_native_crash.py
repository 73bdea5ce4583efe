"""A process whose native code fails must die of the signal, never hang: Paddle's import installs crash
handlers that deadlock in malloc when glibc aborts on a corrupt heap (fastdeploy/fatal_signals.py), and
importing fastdeploy takes them down. Every child is bounded: a hang is killed and fails the test."""
import select
import signal
import subprocess
import sys

import pytest
from test_api_server import Server

CHILD_TIMEOUT_S = 30.0  # importing fastdeploy takes a few seconds; a hang lasts for ever
# A second thread: glibc locks the malloc arenas only in a multi-threaded process, as every real one is (the
# server's HTTP thread, OpenMP's, OpenBLAS's), but a child of pytest may not be: Paddle's import in pytest set
# OMP_NUM_THREADS=1, which the child inherits.
LIBC = """
import ctypes, threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
"""
# Both abort inside free() with the main arena's lock held: chunks too big for the lock-free tcache, and a
# second chunk after the first so that it is not merged into the top chunk.
CORRUPTIONS = {
    "double free": "p = libc.malloc(4000); libc.malloc(4000); libc.free(p); libc.free(p)",
    "overwritten chunk header": "p = libc.malloc(4000); libc.malloc(4000); ctypes.memset(p - 8, 0x41, 8); libc.free(p)",
}


def run_child(code: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # subprocess.run has killed it
        pytest.fail(f"the child hung for {CHILD_TIMEOUT_S} s instead of exiting")


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_heap_corruption_aborts_the_process(corruption):
    done = run_child(f"import fastdeploy\n{LIBC}\n{CORRUPTIONS[corruption]}\nprint('survived')")
    assert done.returncode == -signal.SIGABRT, done.stderr[-2000:]
    assert "double free or corruption" in done.stderr
    assert "survived" not in done.stdout


def caught_signals(status: str) -> set[int]:
    """The signals a /proc/<pid>/status text says have a handler (SigCgt, a hex bit mask)."""
    mask = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_no_fatal_signal_has_a_c_handler_after_import():
    done = run_child("import os, fastdeploy\nprint(open(f'/proc/{os.getpid()}/status').read())")
    assert done.returncode == 0, done.stderr[-2000:]
    fatal = {signal.SIGSEGV, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGTERM}
    assert caught_signals(done.stdout) & fatal == set()


def start_blocked_child(code: str) -> subprocess.Popen:
    """A child that runs `code`, prints 'ready' and blocks; returned once it is ready."""
    proc = subprocess.Popen([sys.executable, "-c", f"{code}\nprint('ready', flush=True)\nimport threading\n"
                             "lock = threading.Lock(); lock.acquire(); lock.acquire()"],  # a futex wait for ever
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    readable, _, _ = select.select([proc.stdout], [], [], CHILD_TIMEOUT_S)
    if not readable or proc.stdout.readline() != "ready\n":
        proc.kill()
        proc.wait()
        pytest.fail(f"the child did not start: {proc.stderr.read()[-2000:]}")
    return proc


def terminate(proc: subprocess.Popen) -> tuple[int, str, str]:
    """SIGTERM `proc`; its exit status and output, failing if it is still there after 10 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("SIGTERM did not end the process")
    return proc.returncode, out, err


def test_sigterm_terminates_a_blocked_process():
    code, out, err = terminate(start_blocked_child("import fastdeploy"))
    assert code == -signal.SIGTERM
    assert "Termination signal" not in out + err  # Paddle's handler would have printed its report


def test_a_python_sigterm_handler_set_before_the_import_is_kept():
    code, out, _ = terminate(start_blocked_child(
        "import os, signal\n"
        "def bye(sig, frame):\n    print('handled', flush=True)\n    os._exit(3)\n"
        "signal.signal(signal.SIGTERM, bye)\nimport fastdeploy"))
    assert (code, out.strip()) == (3, "handled")


def test_a_crashing_server_dumps_its_python_stacks_and_exits(tiny_hf):
    server = Server(tiny_hf)
    try:
        server.proc.send_signal(signal.SIGSEGV)  # as if its native code had crashed
        _, err = server.proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit after SIGSEGV")
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    assert server.proc.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in err  # faulthandler, then the default disposition
    # a Python stack of the process's threads (which frames they are in depends on when the signal lands)
    assert "(most recent call first):" in err and 'File "' in err
