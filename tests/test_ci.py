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
