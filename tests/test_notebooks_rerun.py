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
  name). A cell with a line `# tolerance: X <why, as measured>` has its numbers compared within ±X (integers still
  exactly below 1). Everything else a notebook prints is a claim that must come back on any machine.
- `test_low_precision_training_is_declared`: float32, bf16 and fp16 training is not reproducible across CPUs (AVX-512,
  AVX2 or no vector kernels, `ATEN_CPU_CAPABILITY=default` simulates the last; thread counts), and training amplifies
  the round-off; so is float64 training at a chaotic learning rate. Each kernel runs `PRECISION_PROBE`, which records
  the cells that take two optimizer steps or more and the dtypes of the parameters they step: a cell that trains in
  anything but float64 and prints a compared number must say how it varies (`# tolerance:` or `# varies:`), or train in
  float64. A failing rerun names, for its notebook, which cells print exact numbers (no training), float64-exact ones,
  numbers within a stated tolerance, or `# varies` (`summary`; `conftest.py` lists them after the run).

The notebooks are executed two at a time, each kernel with one thread (`OMP_NUM_THREADS=1`: two kernels with two threads
each on a 2-core machine run several times slower than either alone), the tutorials (the slowest) first so that the
two kernels finish together. Each kernel is forked from a process that imported torch once (`kernel_fork.py`: about
4 s of CPU saved per notebook; `CAPSKIP_FRESH_KERNELS=1` starts a fresh interpreter per notebook instead). They start as soon as pytest has collected the tests (`conftest.py`) and run beside the
other tests, sharing the two cores with them: this file alone took 5 min 35 s (`pytest -q tests/test_notebooks_rerun.py`
on an idle 2-core AMD EPYC VM, 2026-12-03); the whole suite's figures, with their machine, are in DEVELOPING.md.

`CAPSKIP_KERNEL_THREADS=2` runs the kernels with two threads each, as a reader's Run All on a 2-core machine (a
maintainers' check that the committed outputs do not move with the thread count, not the README's command; DEVELOPING.md
has the one for another CPU kind).
"""
import tempfile
from concurrent.futures import ThreadPoolExecutor
import json
import math
import os
import platform
import re
import shutil
import sys
from pathlib import Path

import pytest

import kernel_fork

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
SAME_ON = re.compile(r'^\s*# same on: (\S+ \S+) \S.{8,}', re.M)   # `# same on: CPython 3.11.7 <why>`: compared on that Python only
PYTHON = f'{platform.python_implementation()} {platform.python_version()}'   # the kernels run this interpreter


def other_python(cell: dict) -> str | None:
    "The Python a cell's output was recorded on (`# same on: <Python> <why>`: e.g. it reads that Python's standard library), if this is another one."
    found = SAME_ON.search(''.join(cell.get('source', '')))
    return found.group(1) if found and found.group(1) != PYTHON else None
TOLERANCE = re.compile(r'^\s*# tolerance: ±?(\d+(?:\.\d+)?(?:e-\d+)?) \S.{8,}', re.M)   # a measured bound, and why


def all_notebooks() -> list[str]:
    "Every notebook of `nbs/` (relative paths), the tutorials first: each is executed by `test_run_all`."
    found = [str(p.relative_to(NBS)) for p in sorted(NBS.rglob('*.ipynb'))
             if '.ipynb_checkpoints' not in p.parts and not p.name.startswith('_')]
    return sorted(found, key=lambda rel: not rel.startswith('tutorials/'))


def kernel_env() -> dict:
    "The kernels' environment: this process's as it is now, one thread each (`CAPSKIP_KERNEL_THREADS=N`: N, as a reader's Run All), this interpreter's folder first on PATH."
    threads = os.environ.get('CAPSKIP_KERNEL_THREADS', '1')
    return {**os.environ, 'OMP_NUM_THREADS': threads, 'MKL_NUM_THREADS': threads,
            'PATH': f'{Path(sys.executable).parent}{os.pathsep}{os.environ["PATH"]}'}   # the kernel spec runs `python`


# Which cells train, and in which precision: the kernel runs this before the first cell (`exec_lines`, no output). Once
# torch is imported it registers a global optimizer-step hook that, at the first two steps of each (cell, dtypes), appends
# to the file RECORD which cell it is (the n-th the kernel ran) and the dtypes of the parameters stepped (bf16 autocast
# steps float32 weights). Optimizer steps in a subprocess (a `capskip train` the notebook launches) are not seen.
PRECISION_PROBE = """
import importlib.abc, importlib.util, sys
from IPython import get_ipython
def watch(record):
    steps, cell = {}, [0]
    get_ipython().events.register('pre_run_cell', lambda info: cell.__setitem__(0, cell[0] + bool(info.store_history)))
    def hook(optimizer, args, kwargs):
        dtypes = ','.join(sorted({str(p.dtype).removeprefix('torch.') for g in optimizer.param_groups for p in g['params']}))
        key = (cell[0], dtypes)
        steps[key] = steps.get(key, 0) + 1
        if steps[key] <= 2:
            with open(record, 'a') as f: f.write(f'{key[0]} {dtypes}\\n')
    class AfterTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != 'torch': return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec('torch')
            run = spec.loader.exec_module
            def exec_module(module):
                run(module); register()
            spec.loader.exec_module = exec_module
            return spec
    register = lambda: sys.modules['torch.optim.optimizer'].register_optimizer_step_post_hook(hook)
    if 'torch' in sys.modules: register()
    else: sys.meta_path.insert(0, AfterTorch())
watch(RECORD)
"""


def trained_cells(nb: dict, record: str) -> dict[int, set[str]]:
    """Code cell index -> the parameter dtypes it trained in (two optimizer steps or more: one step from a given model is
    a gradient check, whose numbers come from that model), from the probe's record."""
    ran = [i for i, cell in enumerate(c for c in nb['cells'] if c['cell_type'] == 'code') if cell.get('execution_count')]
    index = {str(n): i for n, i in enumerate(ran, 1)}          # the n-th cell the kernel ran (nbclient skips empty cells)
    out: dict[int, set[str]] = {}
    seen: dict[tuple[int, str], int] = {}
    for line in Path(record).read_text().split('\n') if Path(record).exists() else []:
        if line.strip():
            count, dtypes = line.split(' ', 1)
            if count in index: seen[(index[count], dtypes)] = seen.get((index[count], dtypes), 0) + 1
    for (i, dtypes), n in seen.items():
        if n >= 2: out.setdefault(i, set()).update(dtypes.split(','))
    return out


def execute(rel: str, env: dict | None = None) -> dict:
    """Run every cell of nbs/`rel` in a fresh Python kernel of this interpreter, from the notebook's folder; the notebook,
    with `metadata.trained` {code cell index: [parameter dtypes its optimizer steps used]} from `PRECISION_PROBE`."""
    import nbformat
    from nbclient import NotebookClient
    path = NBS / rel
    nb = nbformat.read(path, as_version=4)
    env = env or kernel_env()
    os.environ['PATH'] = env['PATH']          # jupyter_client looks the kernel's `python` up on this process's PATH
    kernel = 'python3'
    if _ZYGOTE and _ZYGOTE[0].poll() is None:   # a kernel forked with torch already imported (`kernel_fork.py`)
        _, sock, folder = _ZYGOTE
        os.environ['JUPYTER_PATH'] = os.pathsep.join(filter(None, [folder, os.environ.get('JUPYTER_PATH')]))
        env, kernel = {**env, kernel_fork.SOCKET_ENV: sock}, kernel_fork.KERNEL_NAME
    with tempfile.TemporaryDirectory() as tmp:
        probe, record = Path(tmp) / 'probe.py', Path(tmp) / 'trained.txt'
        probe.write_text(PRECISION_PROBE)
        start = f"__import__('runpy').run_path({str(probe)!r}, init_globals={{'RECORD': {str(record)!r}}})"
        client = NotebookClient(nb, timeout=600, kernel_name=kernel, resources={'metadata': {'path': str(path.parent)}},
                                extra_arguments=[f'--IPKernelApp.exec_lines={start}',
                                                 '--IPKernelApp.log_level=ERROR'])   # not its TCP-transport warning in pytest's output
        client.execute(env=env)
        nb.metadata['trained'] = {str(i): sorted(d) for i, d in trained_cells(nb, str(record)).items()}
    return nb


def output_notebooks() -> list[str]:
    "Every notebook committed with outputs (a committed output is a claim)."
    has_outputs = lambda rel: any(c.get('outputs') for c in json.loads((NBS / rel).read_text())['cells'] if c['cell_type'] == 'code')
    return [rel for rel in all_notebooks() if has_outputs(rel)]


EXECUTED = all_notebooks()
COMPARED = output_notebooks()


_RUNS: dict = {}          # notebook -> Future of its executed notebook (or the exception it raised)
_POOL: list = []
SECONDS: dict[str, float] = {}   # notebook -> wall-clock seconds of its kernel run (kernel start included), for the summary


def _run(rel: str, env: dict):
    import time
    start = time.perf_counter()
    try: return json.loads(json.dumps(execute(rel, env)))
    except Exception as err: return err
    finally: SECONDS[rel] = time.perf_counter() - start


_ZYGOTE: list = []     # (process, socket, kernel-spec folder) of the process the kernels are forked from, once started


def start_reruns(rels: list[str]) -> None:
    """Start executing `rels` in the background, two kernels at a time, in the order given.

    `conftest.py` calls this as soon as the tests are collected, so the kernels run beside the rest of the suite
    instead of after it. The environment is taken now, once: a variable a test
    sets later with `monkeypatch` never reaches a kernel."""
    if not _POOL: _POOL.append(ThreadPoolExecutor(2, thread_name_prefix='notebook'))
    env = kernel_env()
    if not _ZYGOTE and os.environ.get('CAPSKIP_FRESH_KERNELS') != '1':   # =1: a fresh interpreter per notebook
        started = kernel_fork.start_zygote(env)
        if started: _ZYGOTE.extend(started)
    for rel in rels:
        if rel not in _RUNS: _RUNS[rel] = _POOL[0].submit(_run, rel, env)


def stop_reruns() -> None:
    "Drop the notebooks not started yet (the session is ending); those running finish. The zygote ends."
    if _POOL: _POOL[0].shutdown(wait=False, cancel_futures=True)
    if _ZYGOTE:
        _ZYGOTE[0].kill(); _ZYGOTE[0].wait()
        shutil.rmtree(_ZYGOTE[2], ignore_errors=True)


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


def same_number(shown: str, got: str, tol: float = 0.0) -> bool:
    """Equal within one unit of the last printed digit (integers exactly), or within a cell's stated `tol`; e-notation
    round-off only has to stay below 1e-4."""
    a, b = float(shown), float(got)
    if 'e' in shown.lower() and abs(a) < ROUNDOFF: return abs(b) < ROUNDOFF
    if abs(a - b) <= tol * 1.001: return True
    if re.fullmatch(r'[-+]?\d+', shown): return a == b
    mantissa = shown.lower().split('e')[0]
    decimals = len(mantissa.split('.')[1]) if '.' in mantissa else 0
    unit = 10.0 ** -decimals * (10.0 ** int(shown.lower().split('e')[1]) if 'e' in shown.lower() else 1)
    return math.isclose(a, b, abs_tol=unit * 1.001)


def tolerance(cell: dict) -> float | None:
    "The bound a cell states beside its output (`# tolerance: 0.01 <why, as measured>`), or None."
    found = TOLERANCE.search(''.join(cell.get('source', '')))
    return float(found.group(1)) if found else None


def differences(committed: dict, rerun: dict) -> list[str]:
    out = []
    for i, (old, new) in enumerate(zip(code_cells(committed), code_cells(rerun))):
        if VARIES.search(''.join(old.get('source', ''))): continue          # says beside its output what varies and why
        if other_python(old): continue                                      # recorded on another Python's text
        tol = tolerance(old) or 0.0
        (s_old, n_old), (s_new, n_new) = skeleton(printed(old)), skeleton(printed(new))
        if s_old != s_new: out.append(f'code cell {i}: the printed text differs:\n--- committed\n{s_old}\n--- rerun\n{s_new}')
        elif not all(same_number(a, b, tol) for a, b in zip(n_old, n_new)):
            bad = [(a, b) for a, b in zip(n_old, n_new) if not same_number(a, b, tol)]
            out.append(f'code cell {i}: numbers differ (committed, rerun{f", stated tolerance {tol:g}" if tol else ""}): {bad[:10]}')
    return out


# ------------------------------------------------------------- how each notebook's numbers can be the same on any CPU
def code_cells(nb: dict) -> list[dict]: return [c for c in nb['cells'] if c['cell_type'] == 'code']


def prints_numbers(cell: dict) -> bool:
    "Whether a cell prints a number that is compared (not a timing, a line measured on this machine, or round-off below 1e-4)."
    return any(not ('e' in n.lower() and abs(float(n)) < ROUNDOFF) for n in skeleton(printed(cell))[1])


def how_compared(rerun: dict) -> dict[int, str]:
    """Each code cell that prints compared numbers -> how they can come back on another CPU: `exact` (no training in the
    cell), `float64` (it trains, every optimizer step on float64 parameters), `within ±X` (`# tolerance: X <why>`),
    `varies` (`# varies: <why>`, not compared), or `UNDECLARED <dtypes>`: it trains in float32 / bf16 / fp16 (bf16
    autocast steps float32 weights) and prints numbers without saying how they vary — kernels and thread counts round
    float32 differently, from the initialisation on, and SGD amplifies it. The dtypes come from `PRECISION_PROBE`
    (`metadata.trained` of the executed notebook); a cell that prints what an *earlier* cell trained is not traced back."""
    trained = rerun.get('metadata', {}).get('trained', {})
    out = {}
    for i, cell in enumerate(code_cells(rerun)):
        if not prints_numbers(cell): continue
        dtypes, tol = set(trained.get(str(i), ())), tolerance(cell)
        if VARIES.search(''.join(cell.get('source', ''))): out[i] = 'varies'
        elif other_python(cell): out[i] = f'varies (recorded on {other_python(cell)})'
        elif tol is not None: out[i] = f'within ±{tol:g}'
        elif not dtypes: out[i] = 'exact'
        elif dtypes == {'float64'}: out[i] = 'float64'
        else: out[i] = 'UNDECLARED ' + ','.join(sorted(dtypes - {'float64'}))
    return out


def summary(rel: str, rerun: dict) -> str:
    "One line: which cells' numbers are exact, float64-exact, compared within a stated tolerance, or excluded (`# varies`)."
    groups: dict[str, list[int]] = {}
    for i, kind in how_compared(rerun).items(): groups.setdefault(kind, []).append(i)
    order = lambda kind: ('exact', 'float64').index(kind) if kind in ('exact', 'float64') else 2 + kind.startswith('varies')
    parts = [f'{kind} cells {",".join(map(str, cells))}' for kind, cells in sorted(groups.items(), key=lambda kv: order(kv[0]))]
    return f'{rel}: ' + ('; '.join(parts) if parts else 'prints no compared number')


SUMMARIES: dict[str, str] = {}           # notebook -> its `summary`, shown by conftest.py's terminal summary


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
    within = lambda text: {'cells': [{**cell(text), 'source': ['# tolerance: 0.02 bf16 training, measured on two CPUs\n', 'fit()']}]}
    assert differences(within('acc 0.944, 5 epochs'), within('acc 0.960, 5 epochs')) == []
    assert differences(within('acc 0.944, 5 epochs'), within('acc 0.970, 5 epochs'))              # past the stated bound
    assert differences(within('acc 0.944, 5 epochs'), within('acc 0.944, 6 epochs'))              # integers stay exact
    assert tolerance({'source': '# tolerance: 0.02\n'}) is None                                  # a bound needs its why
    same_on = lambda python, text: {'cells': [{**cell(text), 'source': [f'# same on: {python} it reads that Python\'s stdlib\n', 'fit()']}]}
    assert differences(same_on(PYTHON, 'loss 3.11'), same_on(PYTHON, 'loss 3.15'))                # this Python: compared
    assert differences(same_on('CPython 0.0.1', 'loss 3.11'), same_on('CPython 0.0.1', 'loss 3.15')) == []   # another one: not


def test_each_cell_says_how_its_numbers_come_back():
    "The classification: no training, float64 training, a stated tolerance, `# varies`, and low precision undeclared."
    cell = lambda text, source='fit()': {'cell_type': 'code', 'source': source,
                                         'outputs': [{'output_type': 'stream', 'name': 'stdout', 'text': text}]}
    nb = {'cells': [cell('kept 11 of 32'), cell('acc 0.944'), cell('acc 0.944'), cell('acc 0.944', '# tolerance: 0.02 bf16, measured twice\nfit()'),
                    cell('peak 35.2 MB', '# varies: memory peak of this machine\nrun()'), cell('error 4.1e-16'), cell('acc 0.9', 'fit()')],
          'metadata': {'trained': {'1': ['float64'], '2': ['bfloat16', 'float32'], '3': ['float32'], '5': ['float32']}}}
    assert how_compared(nb) == {0: 'exact', 1: 'float64', 2: 'UNDECLARED bfloat16,float32', 3: 'within ±0.02', 4: 'varies', 6: 'exact'}
    assert summary('x.ipynb', nb) == ('x.ipynb: exact cells 0,6; float64 cells 1; UNDECLARED bfloat16,float32 cells 2; '
                                      'within ±0.02 cells 3; varies cells 4')


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
    SUMMARIES[rel] = summary(rel, rerun)
    problems = differences(committed, rerun)
    assert not problems, f'{rel} reruns to other results than it shows ({SUMMARIES[rel]}):\n' + '\n'.join(problems)


@pytest.mark.parametrize('rel', COMPARED)
def test_low_precision_training_is_declared(rel, reruns):
    "A cell that trains in float32/bf16/fp16 and prints numbers says how they vary: float64 instead, `# tolerance:`, or `# varies:`."
    rerun = reruns(rel)
    if isinstance(rerun, Exception): raise rerun
    undeclared = {i: kind for i, kind in how_compared(rerun).items() if kind.startswith('UNDECLARED')}
    assert not undeclared, (f'{rel}: code cells {undeclared} train in low precision and print numbers that another CPU '
                            f'rounds differently: train in float64, or add `# tolerance: X <why, measured>` or '
                            f'`# varies: <why>` to the cell')


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
