"""One run folder, one writer, tested with real processes: a second `capskip train` on a held run is refused (exit 75,
the holder named) and leaves the folder untouched; a lock whose process was SIGKILLed is recovered; two trains with
different configurations started together never mix their files; two `capskip sweep` processes split one grid, each run
trained exactly once."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capskip.runs.recipes import resolve_config
from capskip.runs.runio import EXIT_BUSY, LOCK_NAME, RunLock, read_json, read_jsonl, run_dir
from capskip.runs.train import train

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, CAPSKIP_NO_ALLOCATOR_ENV='1', OMP_NUM_THREADS='1')
CAPSKIP = [sys.executable, '-m', 'capskip']
FAST = ['--set', 'batch_size=256', '--set', 'warmup=false']


def capskip(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([*CAPSKIP, *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def test_a_second_process_on_a_held_run_is_refused(tmp_path):
    folder = run_dir(tmp_path, 'digits', 'dense', 1, 1)
    with RunLock(folder):
        proc = capskip('train', '--recipe', 'digits', '--arm', 'dense', '--seed', '1', '--epochs', '1', *FAST,
                       '--out', str(tmp_path), '--quiet')
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == EXIT_BUSY == 75, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and 'being written by another process' in lines[0] and f'pid {os.getpid()}' in lines[0]
        assert sorted(p.name for p in folder.iterdir()) == [LOCK_NAME]       # nothing written by the refused process
    assert list(folder.iterdir()) == []                                        # released: no lock file left


def test_the_lock_of_a_killed_process_is_recovered(tmp_path):
    folder = run_dir(tmp_path, 'digits', 'dense', 1, 1)
    holder = subprocess.Popen([sys.executable, '-c', 'import sys, time\nfrom capskip.runs.runio import RunLock\n'
                               f'RunLock({str(folder)!r}).acquire(); print("held", flush=True); time.sleep(300)'],
                              cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == 'held'
    cfg = resolve_config('digits', {'batch_size': 256, 'warmup': False}, arm='dense', seed=1, epochs=1)
    with pytest.raises(RuntimeError, match=f'pid {holder.pid}'):
        train(cfg, tmp_path, progress='none')
    holder.send_signal(signal.SIGKILL); holder.wait()
    assert json.loads((folder / LOCK_NAME).read_text())['pid'] == holder.pid    # its lock file is still there...
    final = train(cfg, tmp_path, progress='none')                              # ...but held by nobody: recovered
    assert final['complete'] and not (folder / LOCK_NAME).exists()


def test_two_trains_with_different_configs_never_mix_files(tmp_path):
    "Started together on one run folder: one trains; the other is refused while it runs, or finds a different config."
    args = ['train', '--recipe', 'digits', '--arm', 'dense', '--seed', '1', '--epochs', '3', *FAST, '--out', str(tmp_path),
            '--quiet']
    procs = {wd: capskip(*args, '--set', f'weight_decay={wd}') for wd in (0.0, 0.001)}
    results = {wd: (p.wait(timeout=300), p.communicate()) for wd, p in procs.items()}
    codes = sorted(code for code, _ in results.values())
    assert codes in ([0, 2], [0, EXIT_BUSY]), results
    winner = next(wd for wd, (code, _) in results.items() if code == 0)
    loser_err = next(out[1] for wd, (code, out) in results.items() if code != 0)
    assert 'being written by another process' in loser_err or 'different configuration' in loser_err
    folder = run_dir(tmp_path, 'digits', 'dense', 1, 3)
    config, final = read_json(folder / 'config.json'), read_json(folder / 'final.json')
    assert config['weight_decay'] == winner and final['complete']
    printed = json.loads(results[winner][1][0].strip().splitlines()[-1])
    assert printed['test_acc'] == final['test_acc'] and printed['train_time_s'] == final['train_time_s']
    assert [r['epoch'] for r in read_jsonl(folder / 'results.jsonl')] == [1, 2, 3]
    assert not (folder / LOCK_NAME).exists()


def test_two_sweeps_split_one_grid(tmp_path):
    "Each run is trained by exactly one of two sweep processes; the other skips it while held (or reuses it after)."
    args = ['sweep', '--recipe', 'digits', '--arms', 'dense,capskip', '--seeds', '1,2', '--epochs', '1', *FAST,
            '--out', str(tmp_path), '--quiet']
    procs = [capskip(*args), capskip(*args)]
    outs = [p.communicate(timeout=400) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    status = {}            # (arm, seed) -> statuses in the two tables
    for out, _ in outs:
        for m in re.finditer(r'^(dense|capskip)\s+(\d)\s+1\s+(\w+)', out, re.M):
            status.setdefault((m.group(1), int(m.group(2))), []).append(m.group(3))
    assert sorted(status) == [('capskip', 1), ('capskip', 2), ('dense', 1), ('dense', 2)], outs
    for run, seen in status.items():
        assert sorted(seen) in (['done', 'locked'], ['done', 'reused']), (run, seen, outs)
        folder = run_dir(tmp_path, 'digits', run[0], run[1], 1)
        assert read_json(folder / 'final.json')['complete'] and 'resumed' not in read_json(folder / 'config.json')['meta']
    if any('locked' in s for s in status.values()):
        assert any('skipped: another process is writing them' in out for out, _ in outs)
