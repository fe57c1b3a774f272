"""`.ci/run` is honest about itself: the exit status of the README's test command is the CI's, and pytest's
"no tests collected" (exit 5) fails the CI. Run on a copy of the script in a scratch repository whose README's test
command exits with a chosen status, with `python3` shimmed so that no virtual environment is built."""
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_ci(tmp_path: Path, test_rc: int) -> subprocess.CompletedProcess:
    repo = tmp_path / 'repo'
    (repo / '.ci').mkdir(parents=True)
    shutil.copy(ROOT / '.ci' / 'run', repo / '.ci' / 'run')
    (repo / 'README.md').write_text(f'# x\n\n```sh\n. .venv/bin/activate && echo pytest && exit {test_rc}\n```\n')
    shim = tmp_path / 'bin'
    shim.mkdir()
    python3 = shim / 'python3'   # `python3 -m venv .venv` -> a .venv whose pip and activate do nothing
    python3.write_text('#!/bin/sh\nmkdir -p .venv/bin && printf "#!/bin/sh\\n" > .venv/bin/pip && chmod +x .venv/bin/pip '
                       '&& : > .venv/bin/activate\n')
    python3.chmod(python3.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, 'PATH': f'{shim}:{os.environ["PATH"]}'}
    return subprocess.run(['bash', str(repo / '.ci' / 'run')], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize('test_rc', [0, 1, 5])
def test_ci_exit_status_is_the_test_commands(tmp_path, test_rc):
    proc = run_ci(tmp_path, test_rc)
    assert '+ . .venv/bin/activate && echo pytest' in proc.stdout
    assert proc.returncode == test_rc, (proc.stdout, proc.stderr)
    assert ('no tests' in proc.stderr) == (test_rc == 5)


def test_pytest_log_capture_survives_loggers_made_by_background_threads():
    """conftest.py's snapshot table: while a thread creates loggers, as the notebook kernels' clients and the docs build
    do during the suite, pytest's `catching_logs` iterates logging's table at every test phase. Without the snapshot
    this raised "dictionary changed size during iteration" (a CI run at 1702eee ended that way, no test run)."""
    import logging
    import threading
    from _pytest.logging import LogCaptureHandler, catching_logs
    done, errors = threading.Event(), []
    def make():
        for i in range(20000): logging.getLogger(f'capskip.test_background.{i}').propagate = False
        done.set()
    t = threading.Thread(target=make)
    t.start()
    try:
        while not done.is_set():
            try:
                with catching_logs(LogCaptureHandler()): pass
            except RuntimeError as err:
                errors.append(str(err)); break
    finally:
        done.wait(); t.join()
        table = logging.Logger.manager.loggerDict          # the rest of the session should not carry 20000 loggers
        for name in [n for n in table if n.startswith('capskip.test_background')]: del table[name]
    assert not errors, errors
