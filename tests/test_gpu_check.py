"""tools/gpu_check.py — the one command a session lent a GPU runs (issue 20, item 6) — names every CUDA path and runs
on a CPU: its step list, and its cheapest step end to end with the record it leaves."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location('gpu_check', ROOT / 'tools' / 'gpu_check.py')
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_the_cuda_run_covers_every_path(tmp_path):
    steps = gpu_check.steps('cuda', False, tmp_path, tmp_path / 'demo')
    names = [s[0] for s in steps]
    assert names == ['check resnet18_gn', 'check vit_tiny 64 px', 'autograd-native tests', 'bench selector',
                     'bench step resnet18_gn', 'bench step resnet18_gn compiled', 'bench step vit_tiny_64',
                     'bench step vit_tiny_64 compiled', 'demo']
    for name, cmd, env, limit in steps:
        assert 'cuda' in ' '.join(cmd) + str(env), name
        assert 0 < limit <= 600, name                                     # each step bounded (a hang cannot eat the budget)
        if name.startswith(('bench step', 'demo')): assert '--record' in cmd and str(tmp_path) in ' '.join(cmd), name
    quick = [s[0] for s in gpu_check.steps('cpu', True, tmp_path, tmp_path / 'demo')]
    assert 'bench step resnet18_gn compiled' not in quick and 'demo' in quick   # --quick: no compile, the rest kept


def test_a_quick_cpu_run_of_the_selector_step(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / 'tools' / 'gpu_check.py'), '--device', 'cpu', '--quick',
                           '--records', str(tmp_path), '--only', 'bench selector'], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r'^bench selector\s+ok\s', proc.stdout, re.M), proc.stdout
    table = (tmp_path / 'bench_selector_cpu.txt').read_text()
    row = re.search(r'^\s*128 \|\s*100 \|\s*384 \|.*\|\s*(\w+)\s*$', table, re.M)   # B, C, d ... same m*
    assert row and row.group(1) == 'yes', table                           # factorised and materialised agree on m*
    summary = json.loads((tmp_path / 'gpu_check_cpu.json').read_text())
    assert [(s['step'], s['status']) for s in summary] == [('bench selector', 'ok')]
