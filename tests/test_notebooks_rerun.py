"""The suite's notebook test: every notebook in `nbs/` executed the way a reader runs it in JupyterLab — a real Jupyter
kernel (where `__name__ == '__main__'`), every cell in order (`#| eval: false` and test-flagged cells included, which
`nbdev_test` skips), with the notebook's own folder as the working directory. It runs every cell `nbdev_test` runs and
more, so the README's test command runs it instead of `nbdev_test` (which stays the quick check of one notebook).

- `test_run_all`: every notebook survives Run All: no cell raises (the `#| export` cells, the checks, and the
  `__main__` blocks that a kernel runs where `nbdev_test` does not, e.g. `08b_bench_step` and `09e_main`).
- `test_rerun_matches_committed_outputs`: every notebook committed with outputs is re-executed and what its cells
  print is compared with the committed text: the same words, and the same numbers, each within one unit of its last
  printed digit (integers exactly). Not compared: timings (a number followed by s / ms / min), the torch version,
  temporary folders, runs of white space (table columns widen, results re-wrap), figures, stderr, numbers in e-notation
  below 1e-4 (float32 round-off, whose digits differ between CPUs, as the notebooks say beside them: those only have
  to stay below 1e-4), a printed line that says it was `(measured on this machine)`, and a cell whose source says
  beside its output what varies and why, in a line `# varies: <why>` (wall-clock columns, memory peaks, the CPU's
  name). Everything else a notebook prints is a claim that must come back on any machine.

The notebooks are executed two at a time, each kernel with one thread (`OMP_NUM_THREADS=1`: two kernels with two threads
each on a 2-core machine run several times slower than either alone), the tutorials (the slowest) first so that the
two kernels finish together. They start as soon as pytest has collected the tests (`conftest.py`) and run beside the
other tests, sharing the two cores with them: this file alone took 5 min 35 s (`pytest -q tests/test_notebooks_rerun.py`
on an idle 2-core AMD EPYC VM, 2026-12-03); the whole suite's figures, with their machine, are in DEVELOPING.md.
"""
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


def all_notebooks() -> list[str]:
    "Every notebook of `nbs/` (relative paths), the tutorials first: each is executed by `test_run_all`."
    found = [str(p.relative_to(NBS)) for p in sorted(NBS.rglob('*.ipynb'))
             if '.ipynb_checkpoints' not in p.parts and not p.name.startswith('_')]
    return sorted(found, key=lambda rel: not rel.startswith('tutorials/'))


def kernel_env() -> dict:
    "The kernels' environment: this process's as it is now, one thread each, this interpreter's folder first on PATH."
    return {**os.environ, 'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1',
            'PATH': f'{Path(sys.executable).parent}{os.pathsep}{os.environ["PATH"]}'}   # the kernel spec runs `python`


def execute(rel: str, env: dict | None = None) -> dict:
    "Run every cell of nbs/`rel` in a fresh Python kernel of this interpreter, from the notebook's folder; the notebook."
    import nbformat
    from nbclient import NotebookClient
    path = NBS / rel
    nb = nbformat.read(path, as_version=4)
    env = env or kernel_env()
    os.environ['PATH'] = env['PATH']          # jupyter_client looks the kernel's `python` up on this process's PATH
    client = NotebookClient(nb, timeout=600, kernel_name='python3', resources={'metadata': {'path': str(path.parent)}})
    client.execute(env=env)
    return nb


def output_notebooks() -> list[str]:
    "Every notebook committed with outputs (a committed output is a claim)."
    has_outputs = lambda rel: any(c.get('outputs') for c in json.loads((NBS / rel).read_text())['cells'] if c['cell_type'] == 'code')
    return [rel for rel in all_notebooks() if has_outputs(rel)]


EXECUTED = all_notebooks()
COMPARED = output_notebooks()


_RUNS: dict = {}          # notebook -> Future of its executed notebook (or the exception it raised)
_POOL: list = []


def _run(rel: str, env: dict):
    try: return json.loads(json.dumps(execute(rel, env)))
    except Exception as err: return err


def start_reruns(rels: list[str]) -> None:
    """Start executing `rels` in the background, two kernels at a time, in the order given.

    `conftest.py` calls this as soon as the tests are collected, so the kernels run beside the rest of the suite
    instead of after it. The environment is taken now, once: a variable a test
    sets later with `monkeypatch` never reaches a kernel."""
    if not _POOL: _POOL.append(ThreadPoolExecutor(2, thread_name_prefix='notebook'))
    env = kernel_env()
    for rel in rels:
        if rel not in _RUNS: _RUNS[rel] = _POOL[0].submit(_run, rel, env)


def stop_reruns() -> None:
    "Drop the notebooks not started yet (the session is ending); those running finish."
    if _POOL: _POOL[0].shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope='session')
def reruns():
    "The executed notebook `rel` (started in the background by `conftest.py`, or now), or the exception it raised."
    def get(rel: str):
        start_reruns([rel])
        return _RUNS[rel].result()
    return get


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


def test_every_notebook_is_executed():
    "A new notebook is covered without being listed; the two whose `__main__` blocks only a kernel runs are among them."
    assert len(EXECUTED) >= 80 and {'08b_bench_step.ipynb', '09e_main.ipynb', 'index.ipynb'} <= set(EXECUTED)
    assert set(COMPARED) <= set(EXECUTED) and EXECUTED[0].startswith('tutorials/')


def test_every_notebook_with_outputs_is_compared():
    assert len(COMPARED) >= 60 and {'tutorials/01_quickstart.ipynb', 'tutorials/06_text.ipynb', '00_selector.ipynb'} <= set(COMPARED)


@pytest.mark.parametrize('rel', EXECUTED)
def test_run_all(rel, reruns):
    "Run All in a kernel: no cell raises (nbclient raises CellExecutionError naming the cell)."
    nb = reruns(rel)
    if isinstance(nb, Exception): raise nb
    errors = [o for c in nb['cells'] if c['cell_type'] == 'code' for o in c.get('outputs', []) if o['output_type'] == 'error']
    assert not errors, errors


@pytest.mark.parametrize('rel', COMPARED)
def test_rerun_matches_committed_outputs(rel, reruns):
    committed = json.loads((NBS / rel).read_text())
    rerun = reruns(rel)
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
