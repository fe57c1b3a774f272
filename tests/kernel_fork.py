"""Notebook kernels forked from a process that has imported torch once (the suite's kernels, not a user's).

Run All starts a fresh kernel per notebook; importing torch there costs about 4 s of CPU, on a 2-core machine, 92 times.
Here a *zygote* process imports torch and NumPy once; each kernel is a fork of it, so it starts with those
modules loaded and nothing else run: no cell, no tensor op, no thread. What a notebook sees is what a fresh kernel gives
(torch's default generator has the same fixed seed in both; Python's `random` is re-seeded at fork by Python itself),
but for two things shared by every fork: the string-hash seed and NumPy's global generator's seed, which a fresh kernel
draws anew (a notebook must depend on neither: sets are not printed unsorted, randomness goes through seeded
generators). Linux only: on macOS forking a process that has loaded torch's frameworks is not safe.

jupyter_client starts `python kernel_fork.py launch -f {connection_file}` (the kernel spec `capskip-fork`): this small
launcher hands the zygote its arguments, folder, environment and standard streams, and stays alive as the process that
jupyter_client manages, until the kernel exits (forwarding signals to it). Between them, a middle process owns the kernel:
it reports the kernel's exit to the launcher and kills the kernel if the launcher dies. Without a zygote (it failed to
start, or the variable is unset) the launcher becomes a plain `ipykernel_launcher`.
"""
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOCKET_ENV = 'CAPSKIP_KERNEL_ZYGOTE'
KERNEL_NAME = 'capskip-fork'
PRELOAD = ('torch', 'numpy', 'torch._dynamo', 'timm')   # not ipykernel: its traitlets read the environment (JPY_PARENT_PID) when imported


def _send(conn: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack('!I', len(data)) + data)


def _recv(conn: socket.socket):
    head = b''
    while len(head) < 4:
        chunk = conn.recv(4 - len(head))
        if not chunk: return None
        head += chunk
    n, data = struct.unpack('!I', head)[0], b''
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk: return None
        data += chunk
    return json.loads(data)


def _kernel(task: dict, fds: list[int]) -> None:
    "In the forked child: become the launcher's kernel (its streams, folder, environment, arguments) and run ipykernel."
    for fd, std in zip(fds, (0, 1, 2)): os.dup2(fd, std)
    for fd in fds: os.close(fd)
    os.chdir(task['cwd'])
    os.environ.clear(); os.environ.update(task['env'])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD): signal.signal(sig, signal.SIG_DFL)
    sys.argv = [sys.executable] + task['argv']
    code = 0
    try:
        from ipykernel import kernelapp
        kernelapp.launch_new_instance()
    except SystemExit as e: code = e.code if isinstance(e.code, int) else 1
    except BaseException: code = 1
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)


def _middle(conn: socket.socket, task: dict, fds: list[int]) -> None:
    "Fork the kernel, tell the launcher its pid, then wait: its exit code to the launcher, or kill it if the launcher went."
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _kernel(task, fds)
    for fd in fds: os.close(fd)
    _send(conn, {'pid': pid})
    conn.setblocking(False)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            try: _send_blocking(conn, {'exit': code})
            except OSError: pass
            os._exit(0)
        try:
            if conn.recv(1) == b'':                    # the launcher is gone (jupyter_client killed it): end the kernel
                os.kill(pid, signal.SIGKILL)
        except BlockingIOError: pass
        except OSError: os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _send_blocking(conn, obj):
    conn.setblocking(True)
    _send(conn, obj)


def serve(path: str) -> None:
    "The zygote: import PRELOAD, then fork a middle process (and through it a kernel) per launcher that connects."
    for name in PRELOAD: __import__(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)      # middles are reaped by the system
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    server.settimeout(1.0)
    parent = os.getppid()
    Path(path + '.ready').write_text(str(os.getpid()))
    while os.getppid() == parent:                      # the test session that started it is still there
        try: conn, _ = server.accept()
        except TimeoutError: continue
        conn.settimeout(10)
        fds = []
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            while len(msg) >= 4 and len(msg) - 4 < struct.unpack('!I', msg[:4])[0]:
                chunk = conn.recv(1 << 20)
                if not chunk: break
                msg += chunk
            task = json.loads(msg[4:].decode())
        except (OSError, ValueError):
            task = None
        if task is None or len(fds) != 3:
            conn.close(); [os.close(fd) for fd in fds]; continue
        conn.settimeout(None)
        if os.fork() == 0:
            server.close()
            _middle(conn, task, fds)
        conn.close()
        for fd in fds: os.close(fd)


def launch(argv: list[str]) -> None:
    "The kernel spec's command: a kernel forked by the zygote, or a plain ipykernel when there is none."
    path = os.environ.get(SOCKET_ENV)
    conn = None
    if path and os.path.exists(path):
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
        except OSError: conn = None
    if conn is None:
        os.execv(sys.executable, [sys.executable, '-m', 'ipykernel_launcher', *argv])
    task = json.dumps({'argv': argv, 'cwd': os.getcwd(), 'env': dict(os.environ)}).encode()
    socket.send_fds(conn, [struct.pack('!I', len(task)) + task], [0, 1, 2])
    pid = (_recv(conn) or {}).get('pid')
    if pid is None: sys.exit('capskip-fork: the zygote did not start a kernel')
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    reply = _recv(conn)
    sys.exit((reply or {}).get('exit', 1))


def start_zygote(env: dict, timeout: float = 120) -> tuple[subprocess.Popen, str, str] | None:
    """Start a zygote with the kernels' environment `env` (torch reads its thread count at import); returns (process,
    socket path, folder holding the `capskip-fork` kernel spec for JUPYTER_PATH), or None if it did not come up."""
    if not sys.platform.startswith('linux'): return None
    folder = tempfile.mkdtemp(prefix='capskip-kernels-')
    path = os.path.join(folder, 'zygote.sock')
    spec = Path(folder) / 'kernels' / KERNEL_NAME
    spec.mkdir(parents=True)
    (spec / 'kernel.json').write_text(json.dumps({
        'argv': [sys.executable, str(Path(__file__).resolve()), 'launch', '-f', '{connection_file}'],
        'display_name': 'Python 3 (forked, torch preloaded)', 'language': 'python', 'metadata': {'debugger': False}}))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), 'serve', path], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout
    while not os.path.exists(path + '.ready'):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            return None
        time.sleep(0.05)
    return proc, path, folder


if __name__ == '__main__':
    if sys.argv[1] == 'serve': serve(sys.argv[2])
    elif sys.argv[1] == 'launch': launch(sys.argv[2:])
