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


def test_bench_step_unknown_model_is_one_line_before_measuring(monkeypatch, capsys):
    import capskip.bench.step as step
    monkeypatch.setattr(step, 'measure', lambda *a, **k: pytest.fail('the benchmark ran for an unknown model'))
    assert "--model 'nosuch' is not a model: choose one of" in usage_error(capsys, bench_step_main, ['--model', 'nosuch'])


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


# --- every command answers --help and a usage error at once (before torch is imported), and documents every option ---

ANSWER = r'''
import contextlib, io, json, sys
from capskip.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try: code = main(json.loads(sys.argv[1]))
    except SystemExit as e: code = e.code
print(json.dumps({'code': code, 'torch': 'torch' in sys.modules, 'out': out.getvalue(), 'err': err.getvalue()}))
'''


def command_words() -> list[list[str]]:
    "Every command as the words that name it: `train`, ..., and `bench selector`, `bench step`."
    from capskip.cli import COMMANDS
    from capskip.cli.tools import BENCH_COMMANDS
    return [w for name in COMMANDS for w in ([['bench', b] for b in BENCH_COMMANDS] if name == 'bench' else [[name]])]


def parsers() -> dict:
    "Each command's argument parser, taken from its main as it parses (no command runs)."
    import argparse
    from unittest import mock
    from capskip.cli import main
    captured, parse = {}, argparse.ArgumentParser.parse_args
    class Parsed(Exception): pass
    def grab(self, args=None, namespace=None):
        if self.prog in ('capskip', 'capskip bench'): return parse(self, args, namespace)   # the dispatch tables
        captured[self.prog] = self
        raise Parsed
    with mock.patch.object(argparse.ArgumentParser, 'parse_args', grab):
        for words in command_words():
            with pytest.raises(Parsed): main(words)
    return captured


def answer(words: list[str]) -> dict:
    import json
    out = subprocess.run([sys.executable, '-c', ANSWER, json.dumps(words)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, CAPSKIP_NO_ALLOCATOR_ENV='1'))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_command_is_covered():
    found = parsers()
    assert len(found) == len(command_words()) >= 12
    assert {'capskip train', 'capskip check', 'capskip bench step', 'capskip select-demo'} <= set(found)


@pytest.mark.parametrize('words', command_words(), ids=' '.join)
def test_help_and_usage_errors_answer_before_torch_is_imported(words):
    "`--help`, an unknown flag and (where the command has one) a number that is not one: exit 0/2 in a fresh process, torch never imported."
    prog = 'capskip ' + ' '.join(words)
    got = answer(words + ['--help'])
    assert (got['code'], got['torch']) == (0, False), got
    assert got['out'].startswith(f'usage: {prog}')
    got = answer(words + ['--no-such-flag'])
    assert (got['code'], got['torch']) == (2, False), got
    last = got['err'].strip().splitlines()[-1]      # the unknown flag, or first a missing required argument
    assert last in (f'{prog}: error: unrecognized arguments: --no-such-flag',) or \
        last.startswith(f'{prog}: error: the following arguments are required: '), last
    numeric = [a for a in parsers()[prog]._actions if a.type in (int, float) and a.option_strings]
    if numeric:
        got = answer(words + [numeric[0].option_strings[0], 'many'])
        assert (got['code'], got['torch']) == (2, False), got
        assert f"invalid {numeric[0].type.__name__} value: 'many'" in got['err'].strip().splitlines()[-1]


def test_every_option_has_help_and_shows_its_default():
    import argparse
    missing = []
    for prog, parser in parsers().items():
        for a in parser._actions:
            if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS or not a.option_strings: continue
            text = (a.help or '') % {'default': a.default, 'prog': prog}
            if not text.strip(): missing.append(f'{prog} {a.option_strings[0]}: no help text')
            elif a.default not in (None, False, []) and 'default' not in text:
                missing.append(f'{prog} {a.option_strings[0]}: default {a.default!r} not shown')
            elif isinstance(a.default, (int, float, str)) and not isinstance(a.default, bool) and a.default != '' \
                    and str(a.default) not in text:
                missing.append(f'{prog} {a.option_strings[0]}: help shows another default than {a.default!r}')
    assert not missing, '\n'.join(missing)


def test_top_level_help_names_the_modes_check_offers():
    from capskip.cli import COMMANDS
    summary = COMMANDS.get('check').summary
    modes = next(a for a in parsers()['capskip check']._actions if '--mode' in a.option_strings).choices
    assert all(m in summary for m in modes if m != 'all'), summary
    for m in ('masked', 'dense'):
        assert (m in summary) == (m in modes), summary


def test_select_demo_budget_default_is_the_package_constant():
    from capskip.core import DEFAULT_BUDGET
    budget = next(a for a in parsers()['capskip select-demo']._actions if '--budget' in a.option_strings)
    assert budget.default == DEFAULT_BUDGET


@pytest.mark.parametrize('words', [['train', '--help'], ['sweep', '--no-such-flag'], ['demo', '--help']], ids=' '.join)
def test_a_timed_command_from_the_shell_answers_before_torch(words):
    """A timed command re-executes itself with the allocator settings before parsing (capskip.cli.main): that step must
    not import torch either. PYTHONPROFILEIMPORTTIME is inherited by the re-executed process, so both report imports."""
    from capskip.core import TIMING_ALLOCATOR
    env = {k: v for k, v in os.environ.items() if k not in TIMING_ALLOCATOR and k != 'CAPSKIP_NO_ALLOCATOR_ENV'}
    out = subprocess.run([sys.executable, '-m', 'capskip', *words], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**env, 'PYTHONPROFILEIMPORTTIME': '1'})
    imported = [l.rsplit('|', 1)[-1].strip() for l in out.stderr.splitlines() if l.startswith('import time:')]
    assert len(imported) > 20 and 'capskip.cli' in imported, out.stderr[-500:]
    assert out.returncode == (0 if '--help' in words else 2)
    assert 'torch' not in imported, [m for m in imported if m.startswith('torch')][:5]


@pytest.mark.parametrize('argv,message,cwd', [
    (['select-demo', '--budget', '-1'], '--budget must be a finite number >= 0', None),
    (['readme', '--check'], 'no settings.ini found', 'tmp'),
    (['bench', 'step', '--ddp', '1'], '--ddp needs at least 2 processes', None)])
def test_one_line_not_a_traceback(argv, message, cwd, tmp_path):
    proc = subprocess.run([sys.executable, '-m', 'capskip', *argv], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path if cwd else ROOT)
    assert proc.returncode == 2 and message in proc.stderr and 'Traceback' not in proc.stderr, proc.stderr[-800:]
