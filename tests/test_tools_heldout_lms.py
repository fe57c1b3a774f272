"""`tools/heldout_lms.py` (the held-out causal-LM probe): it runs as documented and reports exact gradients for a model the
tests do not build (OPT, and Cohere, whose logits are its head's output times `logit_scale`; left-padded, a 3-token prompt
masked), and a model capskip refuses (Mixtral's experts mix rows, in reuse and reforward) gets its one-line refusal."""
import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / 'tools' / 'heldout_lms.py'


def run(*args):
    got = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    return got.stdout.splitlines()[1:]


def test_a_held_out_lm_is_exact_in_every_mode_and_a_refusal_is_reported():
    rows = run('opt', 'cohere', 'mixtral', '--pad', 'left', '--prompt', '3')
    exact = [l for l in rows if l.startswith(('opt', 'cohere'))]
    assert [l.split()[1] for l in exact] == ['reuse', 'reforward', 'masked'] * 2
    for line in exact:
        worst, overall = map(float, re.search(r'worst (\S+), global (\S+)', line).groups())
        assert worst < 1e-5 and overall < 1e-5, line
    refused = [l for l in rows if l.startswith('mixtral')]
    assert [l.split()[1] for l in refused] == ['reuse', 'reforward', 'masked']
    assert all('refused: RowDependenceError' in l and 'experts' in l for l in refused[:2]), refused


def test_an_unknown_model_is_named():
    got = subprocess.run([sys.executable, str(TOOL), 'llama'], capture_output=True, text=True, timeout=120)
    assert got.returncode != 0 and "unknown model 'llama'" in got.stderr and 'Traceback' not in got.stderr
