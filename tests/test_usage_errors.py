"""Every command-line misuse of issue 10 is one clear line and exit status 2 — never a traceback, never a silent
default — and is caught before any work starts. One case runs as a real process to check what a shell sees."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capskip.cli.method import check_main
from capskip.cli.runs import demo_main, report_main, sweep_main, train_main
from capskip.cli.tools import bench_step_main

ROOT = Path(__file__).resolve().parents[1]
READ_ONLY = '/proc/capskip-out'     # not creatable even by root (os.access would say yes as root)


def usage_error(capsys, main, argv) -> str:
    "Run `main(argv)`; it must end with exit status 2 and one error line (after argparse's usage line); returns it."
    try: code = main(argv)
    except SystemExit as e: code = e.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert 'Traceback' not in err
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith(('usage:', ' '))]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / 'results.txt'
    path.write_text('not a folder')
    return path


@pytest.mark.parametrize('main, argv', [
    (train_main, ['--epochs', '1']), (sweep_main, ['--recipe', 'digits', '--seeds', '1', '--epochs', '1']),
    (demo_main, ['--seeds', '1']),
], ids=['train', 'sweep', 'demo'])
def test_out_that_is_a_file_or_read_only(main, argv, a_file, capsys):
    assert 'is an existing file' in usage_error(capsys, main, argv + ['--out', str(a_file)])
    assert 'is an existing file' in usage_error(capsys, main, argv + ['--out', str(a_file / 'sub')])
    assert 'cannot be written' in usage_error(capsys, main, argv + ['--out', READ_ONLY])
    assert a_file.read_text() == 'not a folder'


def test_report_out_that_is_a_file_or_read_only(tmp_path, a_file, capsys):
    from capskip.testing.files import write_synthetic_results
    runs = write_synthetic_results(tmp_path / 'runs')
    assert 'is an existing file' in usage_error(capsys, report_main, [str(runs), '--no-figures', '--out', str(a_file)])
    assert 'cannot be written' in usage_error(capsys, report_main, [str(runs), '--no-figures', '--out', READ_ONLY])


@pytest.mark.parametrize('main, argv', [
    (train_main, ['--epochs', '1', '--device', 'gpu0']),
    (sweep_main, ['--recipe', 'digits', '--seeds', '1', '--epochs', '1', '--device', 'gpu0']),
], ids=['train', 'sweep'])
def test_a_device_that_is_not_one(main, argv, tmp_path, capsys):
    line = usage_error(capsys, main, argv + ['--out', str(tmp_path)])
    assert "device 'gpu0' is not a device name" in line
    assert not (tmp_path / 'digits').exists()


@pytest.mark.parametrize('flag, value, message', [
    ('--seeds', '1,1', 'seeds has duplicates'), ('--epochs', '0', 'epoch budgets must be >= 1'),
    ('--arms', '', '--arms is empty'), ('--seeds', '', '--seeds is empty'), ('--epochs', ' , ', '--epochs is empty'),
])
def test_sweep_lists(flag, value, message, tmp_path, capsys):
    "An empty list is an error, not the recipe's default; duplicates and budgets below 1 are refused before any run."
    line = usage_error(capsys, sweep_main, ['--recipe', 'digits', flag, value, '--out', str(tmp_path)])
    assert message in line
    assert not (tmp_path / 'digits').exists()


@pytest.mark.parametrize('argv, message', [
    (['--model', 'timm:not_a_model'], "unknown model 'timm:not_a_model'"),
    (['--model', 'digits_cnn', '--num-classes', '0'], '--num-classes must be >= 2'),
])
def test_check_model_and_classes(argv, message, capsys):
    assert message in usage_error(capsys, check_main, argv)


def test_bench_step_json_is_checked_before_the_benchmark(tmp_path, monkeypatch, capsys):
    import capskip.bench.step as step
    monkeypatch.setattr(step, 'measure', lambda *a, **k: pytest.fail('the benchmark ran before the --json path was checked'))
    for path, message in ((tmp_path / 'no' / 'such' / 'rows.json', 'does not exist'), (Path('/proc/rows.json'), 'cannot be written'),
                          (tmp_path, 'is a folder')):
        assert message in usage_error(capsys, bench_step_main, ['--model', 'digits_cnn', '--json', str(path)])


def test_a_real_process_prints_no_traceback(tmp_path, a_file):
    env = dict(os.environ, CAPSKIP_NO_ALLOCATOR_ENV='1')
    out = subprocess.run([sys.executable, '-m', 'capskip', 'sweep', '--recipe', 'digits', '--seeds', '', '--out', str(a_file)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and 'Traceback' not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == 'capskip sweep: error: --seeds is empty: give comma-separated values, ' \
                                                  'e.g. 1,2,3 (or leave the flag out)'


@pytest.mark.parametrize('argv, message', [
    (['--arms', ','], '--arms is empty'),
    (['--arms', 'dense,nosuch'], "unknown arm(s) ['nosuch']"),
    (['--recipe', 'nosuch'], "unknown recipe 'nosuch'"),
], ids=['empty-arms', 'unknown-arm', 'unknown-recipe'])
def test_demo_arms_and_recipe_are_checked_before_any_training(argv, message, tmp_path, capsys):
    "Before: an empty --arms was a traceback, and an unknown arm trained the dense arm first and then failed (exit 1)."
    out = tmp_path / 'demo'
    assert message in usage_error(capsys, demo_main, argv + ['--out', str(out)])
    assert not out.exists()
