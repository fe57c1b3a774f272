"""Notebooks rerun to what they show, executed the way a reader runs them in JupyterLab: a real Jupyter kernel (where
`__name__ == '__main__'`), every cell in order (`#| eval: false` and test-flagged cells included, which `nbdev_test`
skips), with the notebook's own folder as the working directory.

- `test_run_all`: every notebook with a cell `nbdev_test` skips, or one that tests `__name__`, must survive Run All
  (found by scanning `nbs/`, so a new one is covered; today `08b_bench_step` and `09e_main`).
- `test_rerun_matches_committed_outputs`: every notebook committed with outputs is re-executed and what its cells
  print is compared with the committed text: the same words, and the same numbers, each within one unit of its last
  printed digit (integers exactly). Not compared: timings (a number followed by s / ms / min), the torch version,
  temporary folders, runs of white space (table columns widen, results re-wrap), figures, stderr, numbers in e-notation
  below 1e-4 (float32 round-off, whose digits differ between CPUs, as the notebooks say beside them: those only have
  to stay below 1e-4), a printed line that says it was `(measured on this machine)`, and a cell whose source says
  beside its output what varies and why, in a line `# varies: <why>` (wall-clock columns, memory peaks, the CPU's
  name). Everything else a notebook prints is a claim that must come back on any machine.

The notebooks are executed two at a time, each kernel with one thread (`OMP_NUM_THREADS=1`: two kernels with two threads
each on a 2-core machine run several times slower than either alone).
"""
import configparser
import tempfile
from concurrent.futures import ThreadPoolExecutor
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / 'nbs'
ROUNDOFF = 1e-4          # e-notation numbers below this are round-off measurements: compared as "still below it"
NUMBER = re.compile(r'(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])')
TIMING = re.compile(r'[-+]?\d+(?:\.\d+)?\s?(?:s|ms|min)\b')
VERSION = re.compile(r'\btorch \S+')
TMPDIR = re.compile(re.escape(tempfile.gettempdir().rstrip('/')) + r'/tmp[\w-]+')
SPACES = re.compile(r'\s+')
MACHINE = '(measured on this machine)'
VARIES = re.compile(r'^\s*# varies: \S.{8,}', re.M)      # a reason of a few words, beside the output


def _directives(source: str) -> dict:
    out = {}
    for line in source.splitlines():
        if not line.startswith('#|'): break
        words = line[2:].replace(':', ': ', 1).split()
        if words: out[words[0].rstrip(':')] = words[1:]
    return out


def _skipped_by_nbdev_test(cell: dict, flags: set) -> bool:
    d = _directives(''.join(cell['source']))
    return d.get('eval', [''])[0].lower() == 'false' or bool(flags & d.keys())


def run_all_notebooks() -> list[str]:
    "Notebooks whose Run All differs from what `nbdev_test` runs: a cell it skips, or code that tests `__name__`."
    cfg = configparser.ConfigParser(); cfg.read(ROOT / 'settings.ini')
    flags = set(cfg['DEFAULT'].get('tst_flags', '').split())
    found = []
    for path in sorted(NBS.rglob('*.ipynb')):
        if '.ipynb_checkpoints' in path.parts or path.name.startswith('_'): continue
        cells = [c for c in json.loads(path.read_text())['cells'] if c['cell_type'] == 'code']
        if any(_skipped_by_nbdev_test(c, flags) or re.search(r'\b__name__\s*==', ''.join(c['source'])) for c in cells):
            found.append(str(path.relative_to(NBS)))
    return found


def execute(rel: str) -> dict:
    "Run every cell of nbs/`rel` in a fresh Python kernel of this interpreter, from the notebook's folder; the notebook."
    import nbformat
    from nbclient import NotebookClient
    path = NBS / rel
    nb = nbformat.read(path, as_version=4)
    os.environ['PATH'] = f'{Path(sys.executable).parent}{os.pathsep}{os.environ["PATH"]}'   # the kernel spec runs `python`
    client = NotebookClient(nb, timeout=600, kernel_name='python3', resources={'metadata': {'path': str(path.parent)}})
    client.execute(env={**os.environ, 'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1'})
    return nb


def output_notebooks() -> list[str]:
    "Every notebook committed with outputs (a committed output is a claim)."
    found = []
    for path in sorted(NBS.rglob('*.ipynb')):
        if '.ipynb_checkpoints' in path.parts or path.name.startswith('_'): continue
        cells = json.loads(path.read_text())['cells']
        if any(c.get('outputs') for c in cells if c['cell_type'] == 'code'): found.append(str(path.relative_to(NBS)))
    return found


COMPARED = output_notebooks()
EXECUTED = sorted(set(COMPARED) | set(run_all_notebooks()))


@pytest.fixture(scope='session')
def reruns() -> dict:
    "Each notebook of `EXECUTED` run once, two at a time: the executed notebook, or the exception it raised."
    def run(rel):
        try: return json.loads(json.dumps(execute(rel)))
        except Exception as err: return err
    with ThreadPoolExecutor(2) as pool: return dict(zip(EXECUTED, pool.map(run, EXECUTED)))


def printed(cell: dict) -> str:
    "What a code cell printed: stdout and the text of its result (no figures, no stderr)."
    parts = []
    for o in cell.get('outputs', []):
        if o['output_type'] == 'stream' and o['name'] == 'stdout': parts.append(''.join(o['text']))
        elif o['output_type'] == 'execute_result': parts.append(''.join(o['data'].get('text/plain', '')))
    return ''.join(parts)


def skeleton(text: str) -> tuple[str, list[str]]:
    "The text without lines measured on this machine, with timings, the torch version and temporary folders blanked, runs of spaces as one, every number replaced by #; and the numbers."
    text = '\n'.join(line for line in text.split('\n') if MACHINE not in line)
    text = SPACES.sub(' ', TMPDIR.sub('TMP', VERSION.sub('torch V', TIMING.sub('T', text))))
    return NUMBER.sub('#', text), NUMBER.findall(text)


def same_number(shown: str, got: str) -> bool:
    "Equal within one unit of the last printed digit (integers exactly); e-notation round-off only has to stay below 1e-4."
    a, b = float(shown), float(got)
    if 'e' in shown.lower() and abs(a) < ROUNDOFF: return abs(b) < ROUNDOFF
    if re.fullmatch(r'[-+]?\d+', shown): return a == b
    mantissa = shown.lower().split('e')[0]
    decimals = len(mantissa.split('.')[1]) if '.' in mantissa else 0
    unit = 10.0 ** -decimals * (10.0 ** int(shown.lower().split('e')[1]) if 'e' in shown.lower() else 1)
    return math.isclose(a, b, abs_tol=unit * 1.001)


def differences(committed: dict, rerun: dict) -> list[str]:
    out = []
    code = lambda nb: [c for c in nb['cells'] if c['cell_type'] == 'code']
    for i, (old, new) in enumerate(zip(code(committed), code(rerun))):
        if VARIES.search(''.join(old.get('source', ''))): continue          # says beside its output what varies and why
        (s_old, n_old), (s_new, n_new) = skeleton(printed(old)), skeleton(printed(new))
        if s_old != s_new: out.append(f'code cell {i}: the printed text differs:\n--- committed\n{s_old}\n--- rerun\n{s_new}')
        elif not all(same_number(a, b) for a, b in zip(n_old, n_new)):
            bad = [(a, b) for a, b in zip(n_old, n_new) if not same_number(a, b)]
            out.append(f'code cell {i}: numbers differ (committed, rerun): {bad[:10]}')
    return out


def test_the_comparison_can_fail():
    "The comparison itself: a changed count, a word, an accuracy past its last digit fail; timings and round-off do not."
    assert same_number('0.906', '0.907') and not same_number('0.906', '0.878')
    assert same_number('200', '200') and not same_number('200', '224')
    assert same_number('4.30e-07', '9.1e-06') and not same_number('4.30e-07', '2e-04')
    assert same_number('1.5e+03', '1.6e+03') and not same_number('1.5e+03', '1.7e+03')
    assert skeleton('agree: True (0.3 s), torch 2.14.1+cu130')[0] == skeleton('agree: True (12.0 s), torch 2.4.0')[0]
    assert skeleton('agree: True')[0] != skeleton('agree: False')[0]
    cell = lambda text: {'cell_type': 'code', 'outputs': [{'output_type': 'stream', 'name': 'stdout', 'text': [text]}]}
    nb = lambda text: {'cells': [cell(text)]}
    assert differences(nb('200 of 256 rows'), nb('200 of 256 rows')) == []
    assert differences(nb('200 of 256 rows'), nb('224 of 256 rows'))
    assert same_number('1e5', '1e5') and not same_number('1e5', '3e5')
    tmp = tempfile.gettempdir()
    assert differences(nb(f'wrote {tmp}/tmpab_12/x  1'), nb(f'wrote {tmp}/tmpZZ9/x 1')) == []      # a temporary folder, a column
    assert differences(nb('ratio 1.30 (measured on this machine)\nkept 0.65'), nb('ratio 0.73 (measured on this machine)\nkept 0.65')) == []
    assert differences(nb('ratio 1.30 (measured on this machine)\nkept 0.65'), nb('ratio 0.73 (measured on this machine)\nkept 0.60'))
    varies = lambda text: {'cells': [{**cell(text), 'source': ['# varies: wall-clock seconds of this machine\n', 'run()']}]}
    assert differences(varies('12.5 ms'), varies('99.1 ms')) == [] and not VARIES.search('# varies: x')


def test_run_all_finds_the_notebooks_with_main_blocks():
    found = run_all_notebooks()
    assert {'08b_bench_step.ipynb', '09e_main.ipynb'} <= set(found), found


def test_every_notebook_with_outputs_is_compared():
    assert len(COMPARED) >= 60 and {'tutorials/01_quickstart.ipynb', 'tutorials/06_text.ipynb', '00_selector.ipynb'} <= set(COMPARED)


@pytest.mark.parametrize('rel', run_all_notebooks())
def test_run_all(rel, reruns):
    "Run All in a kernel: no cell raises (nbclient raises CellExecutionError naming the cell)."
    nb = reruns[rel]
    if isinstance(nb, Exception): raise nb
    errors = [o for c in nb['cells'] if c['cell_type'] == 'code' for o in c.get('outputs', []) if o['output_type'] == 'error']
    assert not errors, errors


@pytest.mark.parametrize('rel', COMPARED)
def test_rerun_matches_committed_outputs(rel, reruns):
    committed = json.loads((NBS / rel).read_text())
    rerun = reruns[rel]
    if isinstance(rerun, Exception): raise rerun
    problems = differences(committed, rerun)
    assert not problems, f'{rel} reruns to other results than it shows:\n' + '\n'.join(problems)


def test_progress_bars_render_as_widgets_in_a_kernel():
    "tqdm's notebook bars need ipywidgets (settings.ini dev extras): without it a kernel warns 'IProgress not found'."
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('from tqdm.auto import tqdm\nfor _ in tqdm(range(3)): pass')])
    os.environ['PATH'] = f'{Path(sys.executable).parent}{os.pathsep}{os.environ["PATH"]}'
    NotebookClient(nb, timeout=120, kernel_name='python3').execute()
    outputs = nb.cells[0].outputs
    assert not any('IProgress' in ''.join(o.get('text', '')) for o in outputs), outputs
    assert any('application/vnd.jupyter.widget-view+json' in o.get('data', {}) for o in outputs), outputs
