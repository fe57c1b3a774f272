"""`capskip data`: where CIFAR-100 goes, verify against the official MD5s, a failed fetch as one line (issue 22 §5)."""
import subprocess
import sys
from pathlib import Path

import capskip.runs.data as data_module
from capskip.cli.data import data_main
from capskip.runs.checks import CIFAR100_MD5, file_md5, verify_cifar100
from capskip.testing.files import write_fake_cifar100

ROOT = Path(__file__).resolve().parents[1]


def test_where_runs_from_the_command_line_without_data(tmp_path):
    out = subprocess.run([sys.executable, '-m', 'capskip', 'data', 'where', '--data-root', str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and f'{tmp_path}/cifar-100-python/train' in out.stdout
    assert all(m in out.stdout for m in CIFAR100_MD5.values())


def test_verify_passes_the_official_checksums_and_names_every_other_file(tmp_path, capsys, monkeypatch):
    write_fake_cifar100(tmp_path)
    assert data_main(['verify', '--data-root', str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out.count('not the official file') == 3 and err.count('\n') == 1 and 'Traceback' not in err
    official = {n: file_md5(tmp_path / 'cifar-100-python' / n) for n in CIFAR100_MD5}   # these files, taken as official
    monkeypatch.setattr('capskip.runs.checks.CIFAR100_MD5', official)
    assert set(verify_cifar100(tmp_path).values()) == {'ok'}
    (tmp_path / 'cifar-100-python' / 'test').write_bytes(b'truncated')
    assert verify_cifar100(tmp_path)['test'].startswith('md5 ')


def test_a_failed_fetch_is_one_line_with_the_manual_way(tmp_path, capsys, monkeypatch):
    class NoNetwork(data_module.CIFAR100Files):
        def download(self): raise OSError('Temporary failure in name resolution')
    monkeypatch.setattr(data_module, 'CIFAR100Files', NoNetwork)
    assert data_main(['fetch', '--data-root', str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert 'cannot fetch CIFAR-100' in err and 'capskip data verify' in err and err.count('\n') == 1
