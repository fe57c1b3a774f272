"""`tools/loss_path.py` (the LM user path's benchmark): a bad `--keep` is one line naming the fix, before any model is built."""
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / 'tools' / 'loss_path.py'


def test_a_bad_kept_fraction_is_one_line_naming_the_fix():
    for keep, says in (('2', 'each kept fraction must lie in (0, 1]'), ('half', 'kept fractions separated by commas')):
        got = subprocess.run([sys.executable, str(TOOL), '--keep', keep], capture_output=True, text=True, timeout=120)
        assert got.returncode != 0 and got.stdout == ''
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and 'Traceback' not in got.stderr, got.stderr
