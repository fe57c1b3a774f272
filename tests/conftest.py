"""Test-session settings: property tests draw the same examples on every CI run (derandomised), and explore freely
elsewhere; the notebooks that `tests/test_notebooks_rerun.py` executes start in the background once the tests are
collected, so the kernels run beside the other tests."""
import os

from hypothesis import settings

settings.register_profile('ci', derandomize=True, print_blob=True)
if os.environ.get('CI'):
    settings.load_profile('ci')


def _notebook_items(session) -> list:
    return [item for item in session.items if 'reruns' in getattr(item, 'fixturenames', ()) and hasattr(item, 'callspec')]


def pytest_collection_finish(session):
    items = _notebook_items(session)
    if not items or session.config.option.collectonly: return
    module = items[0].module
    wanted = {item.callspec.params['rel'] for item in items}
    module.start_reruns([rel for rel in module.EXECUTED if rel in wanted])


def pytest_sessionfinish(session):
    items = _notebook_items(session)
    if items: items[0].module.stop_reruns()


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
