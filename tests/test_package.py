"""Package-level checks: the CLI lists every subcommand, README and index notebook agree, exports are in sync."""
import subprocess
import sys
from pathlib import Path

import pytest

from capskip.cli import COMMANDS, BENCH_COMMANDS, main, readme_from_notebook, resolve

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(['--help'])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize('name', sorted(COMMANDS))
def test_every_subcommand_resolves(name):
    assert callable(resolve(COMMANDS[name][0]))


@pytest.mark.parametrize('name', sorted(BENCH_COMMANDS))
def test_every_bench_resolves(name):
    assert callable(resolve(BENCH_COMMANDS[name][0]))


def test_readme_matches_index_notebook():
    assert (ROOT / 'README.md').read_text(encoding='utf-8') == readme_from_notebook(ROOT / 'nbs' / 'index.ipynb'), \
        'README.md is stale: run `capskip readme` and commit both'


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / 'README.md').read_text(encoding='utf-8')
    lines = [l for l in readme.splitlines() if l.startswith('. .venv/bin/activate && ') and 'nbdev_test' in l]
    assert len(lines) == 1, 'the README must hold exactly one test command'
    assert 'pytest' in lines[0]
    ci = (ROOT / '.ci' / 'run').read_text(encoding='utf-8')
    assert "grep -m1 -E '^\\. \\.venv/bin/activate && .*nbdev_test' README.md" in ci


def test_quickstart_has_exactly_two_commands():
    readme = (ROOT / 'README.md').read_text(encoding='utf-8')
    section = readme.split('## Quickstart', 1)[1].split('\n## ', 1)[0]
    assert section.count('```sh') == 2


def test_console_script_help_runs():
    exe = Path(sys.executable).with_name("capskip")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and 'subcommands' in out.stdout


def test_exported_modules_match_notebooks(tmp_path):
    """nbdev_export into a scratch copy must reproduce the committed capskip/ byte for byte."""
    import shutil
    dst = tmp_path / 'repo'
    shutil.copytree(ROOT / 'nbs', dst / 'nbs')
    shutil.copytree(ROOT / 'capskip', dst / 'capskip', ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copy(ROOT / 'settings.ini', dst / 'settings.ini')
    before = {p.relative_to(dst): p.read_bytes() for p in (dst / 'capskip').rglob('*.py')}
    subprocess.run([sys.executable, '-c', 'from nbdev.doclinks import nbdev_export; nbdev_export()'], cwd=dst, check=True)
    after = {p.relative_to(dst): p.read_bytes() for p in (dst / 'capskip').rglob('*.py')}
    stale = sorted(str(p) for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert not stale, f'capskip/ differs from what nbs/ exports: {stale} (edit the notebook, run nbdev_export, commit both)'
