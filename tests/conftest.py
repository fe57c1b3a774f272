"""Test-session settings: property tests draw the same examples on every CI run (derandomised), and explore freely
elsewhere; the notebooks that `tests/test_notebooks_rerun.py` executes start in the background once the tests are
collected, so the kernels run beside the other tests."""
import os

# One thread per process, unless the caller chose: the notebook kernels (one thread each) share the cores with the tests,
# and a test process with a second OpenMP thread then waits at every parallel op for a thread the kernels have
# descheduled. Measured on the 2-core VM beside two busy processes: one EfficientFormerV2 gradient test took 29-107 s of
# wall-clock with two threads and 9-16 s with one. Set before torch is imported; subprocesses the tests start inherit it.
for _name in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS'): os.environ.setdefault(_name, '1')

import logging

import pytest
from hypothesis import settings


class _SnapshotLoggers(dict):
    """logging's table of loggers, whose `values()` is a snapshot. pytest iterates that table at every test phase
    (`catching_logs`), while this session's background threads (the notebook kernels' clients, the docs build) create
    loggers; a logger added during that loop ended a CI run with "RuntimeError: dictionary changed size during
    iteration" (an INTERNALERROR, no test run). `list()` of a dict copies it without releasing the GIL."""
    def values(self): return list(super().values())


logging.Logger.manager.loggerDict = _SnapshotLoggers(logging.Logger.manager.loggerDict)

settings.register_profile('ci', derandomize=True, print_blob=True)
if os.environ.get('CI'):
    settings.load_profile('ci')


@pytest.fixture
def compile_backend(monkeypatch):
    """`compile_backend('aot_eager')`: for this test, a `torch.compile` call that names no backend (capskip's own) uses this
    one. Inductor's C++ codegen costs ~25-30 s a case on a fresh 2-core machine (cold cache); `aot_eager` keeps the same
    dynamo capture and AOT graphs, so each test file runs inductor in one case only."""
    def use(backend: str) -> None:
        import torch
        real = torch.compile
        def compile(fn=None, **kw):
            kw.setdefault('backend', backend)
            return real(fn, **kw)
        monkeypatch.setattr(torch, 'compile', compile)
    return use


def _notebook_items(session) -> list:
    return [item for item in session.items if 'reruns' in getattr(item, 'fixturenames', ()) and hasattr(item, 'callspec')]


def _site_items(session) -> list:
    return [item for item in session.items if {'built', 'seen'} & set(getattr(item, 'fixturenames', ()))]


# Test files whose tests start two processes at a time (data-parallel ranks, two sweeps sharing a grid).
PROCESS_PAIRS = {'test_accelerate.py', 'test_bench_ddp.py', 'test_ddp.py', 'test_ddp_autograd.py', 'test_fsdp_refusal.py',
                 'test_locks.py', 'test_reproduce.py'}


def _order(item) -> int:
    "0: one process (runs beside the two notebook kernels); 1: two processes; 2: waits for background work."
    names = set(getattr(item, 'fixturenames', ()))
    if 'reruns' in names or {'built', 'seen'} & names: return 2
    return int(item.path.name in PROCESS_PAIRS or 'ddp_ranks' in names)


def pytest_collection_modifyitems(session, config, items):
    """The one-process tests first, while the notebook kernels (one core each) run; then the tests that start two
    processes, which keep both cores busy once the kernels are done; last, the tests that wait for background work (the
    notebooks' results, the docs site), by then computed. Within each group, the collection order."""
    items[:] = sorted(items, key=_order)      # a stable sort


def pytest_collection_finish(session):
    if session.config.option.collectonly: return
    items = _notebook_items(session)
    if items:
        module = items[0].module
        wanted = {item.callspec.params['rel'] for item in items}
        module.start_reruns([rel for rel in module.EXECUTED if rel in wanted])
    site = _site_items(session)
    if site: site[0].module.start_site()


def pytest_sessionfinish(session):
    items = _notebook_items(session)
    if items: items[0].module.stop_reruns()
    site = _site_items(session)
    if site: site[0].module.stop_site()


def pytest_terminal_summary(terminalreporter, config):
    "How each compared notebook's numbers come back on another CPU (`test_notebooks_rerun.summary`), after a run of those tests."
    import sys
    module = sys.modules.get('test_notebooks_rerun') or sys.modules.get('tests.test_notebooks_rerun')
    seconds = getattr(module, 'SECONDS', {})
    if seconds:
        slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:8]
        terminalreporter.section('notebook kernels: the slowest (wall-clock, two kernels beside the other tests)')
        terminalreporter.write_line(f'{len(seconds)} notebooks, {sum(seconds.values()) / 60:.1f} kernel-minutes in all; '
                                    + ', '.join(f'{rel} {s:.0f} s' for rel, s in slowest))
    lines = sorted(getattr(module, 'SUMMARIES', {}).values())
    if not lines: return
    shown = lines if config.option.verbose > 0 else [line for line in lines if 'within' in line or 'varies' in line or 'UNDECLARED' in line]
    terminalreporter.section('notebook outputs: exact, float64-exact, within a stated tolerance, or # varies')
    import torch
    from capskip.bench.step import machine_name
    terminalreporter.write_line(f'rerun on {machine_name()}, ATen CPU kernels {torch.backends.cpu.get_cpu_capability()} '
                                f'(the committed outputs name no machine: they must come back on any)')
    for line in shown: terminalreporter.write_line(line)
    if len(shown) < len(lines): terminalreporter.write_line(f'({len(lines) - len(shown)} more print only exact or float64-exact numbers: -v lists them)')
