"""Package-level checks: the CLI lists every subcommand, README and index notebook agree, exports are in sync,
and the architecture holds (imports point only downward, no private names cross modules, small modules,
an explicit public API, notebooks committed with their outputs)."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import capskip
from capskip.cli import COMMANDS, main
from capskip.cli.dispatch import resolve

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / 'capskip'


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(['--help'])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize('name', COMMANDS.list())
def test_every_subcommand_resolves(name):
    assert callable(resolve(COMMANDS[name]))


def test_help_does_not_import_torch():
    code = ('import sys, contextlib, io\nfrom capskip.cli import main\n'
            'with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main(["--help"])\n'
            'assert "torch" not in sys.modules, "capskip --help imported torch"')
    subprocess.run([sys.executable, '-c', code], check=True)


def test_readme_matches_index_notebook():
    from capskip._docs.readme import readme_from_notebook
    assert (ROOT / 'README.md').read_text(encoding='utf-8') == readme_from_notebook(ROOT / 'nbs' / 'index.ipynb'), \
        'README.md is stale: run `capskip readme` and commit both'


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / 'README.md').read_text(encoding='utf-8')
    lines = [l for l in readme.splitlines() if l.startswith('. .venv/bin/activate && ') and 'pytest' in l]
    assert len(lines) == 1, 'the README must hold exactly one test command'
    assert lines[0].endswith('pytest -q tests')                  # every test, the notebooks' (test_notebooks_rerun.py) among them
    ci = (ROOT / '.ci' / 'run').read_text(encoding='utf-8')
    assert "grep -m1 -E '^\\. \\.venv/bin/activate && .*pytest' README.md" in ci


def test_quickstart_has_exactly_two_commands():
    readme = (ROOT / 'README.md').read_text(encoding='utf-8')
    section = readme.split('## Quickstart', 1)[1].split('\n## ', 1)[0]
    assert section.count('```sh') == 2


def test_console_script_help_runs():
    exe = Path(sys.executable).with_name("capskip")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and 'subcommands' in out.stdout


def test_python_m_capskip_runs():
    out = subprocess.run([sys.executable, '-m', 'capskip', '--version'], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == capskip.__version__


def test_exported_modules_match_notebooks(tmp_path):
    """nbdev_export into a scratch copy must reproduce the committed capskip/ byte for byte."""
    import shutil
    dst = tmp_path / 'repo'
    shutil.copytree(ROOT / 'nbs', dst / 'nbs')
    shutil.copytree(PKG, dst / 'capskip', ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copy(ROOT / 'settings.ini', dst / 'settings.ini')
    before = {p.relative_to(dst): p.read_bytes() for p in (dst / 'capskip').rglob('*.py')}
    subprocess.run([sys.executable, '-c', 'from nbdev.doclinks import nbdev_export; nbdev_export()'], cwd=dst, check=True)
    after = {p.relative_to(dst): p.read_bytes() for p in (dst / 'capskip').rglob('*.py')}
    stale = sorted(str(p) for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert not stale, f'capskip/ differs from what nbs/ exports: {stale} (edit the notebook, run nbdev_export, commit both)'


# ---------------------------------------------------------------- architecture
def modules() -> dict[str, Path]:
    "Every module of the package by dotted name (a package by its own name)."
    out = {}
    for f in PKG.rglob('*.py'):
        name = '.'.join(f.relative_to(ROOT).with_suffix('').parts)
        out[name[:-len('.__init__')] if name.endswith('.__init__') else name] = f
    return out


def imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    "(module imported, names taken from it) for every import in the file, lazy ones inside functions included."
    pkg = name.split('.') if path.name == '__init__.py' else name.split('.')[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        if isinstance(node, ast.ImportFrom):
            base = '.'.join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else [])) if node.level else node.module
            out.append((base, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    g = {m: set() for m in mods}
    for m, f in mods.items():
        if m.endswith('_modidx'): continue
        for target, names in imports(m, f):
            for t in [target] + [f'{target}.{n}' for n in names]:
                if t in mods and t not in (m, 'capskip'): g[m].add(t)
    return g


def test_no_import_cycles():
    g, state, cycles = graph(), {}, []
    def visit(u, stack):
        state[u] = 1; stack.append(u)
        for v in sorted(g[u]):
            if state.get(v) == 1: cycles.append(' -> '.join(stack[stack.index(v):] + [v]))
            elif v not in state: visit(v, stack)
        stack.pop(); state[u] = 2
    for m in sorted(g):
        if m not in state: visit(m, [])
    assert not cycles, cycles


def test_no_module_imports_its_own_package_init():
    "Inside a subpackage, modules import their siblings, never the package's __init__ (which imports them)."
    bad = [(m, t) for m, ts in graph().items() for t in ts if m.startswith(t + '.')]
    assert not bad, bad


LAYERS = ['capskip._modidx', 'capskip.registry', 'capskip.checks', 'capskip.core', 'capskip.selector', 'capskip.sequence', 'capskip.sequence_bounds',
          'capskip.engine', 'capskip.reweight', 'capskip.steps', 'capskip.skip',
          'capskip.policies', 'capskip.runs', 'capskip.integrations', 'capskip.analysis', 'capskip.bench', 'capskip.testing', 'capskip._docs',
          'capskip.cli', 'capskip.__main__']


def layer(module: str) -> int:
    for i, top in enumerate(LAYERS):
        if module == top or module.startswith(top + '.'): return i
    raise AssertionError(f'{module} is in no layer of {LAYERS}: add it')


def test_imports_point_only_downward():
    up = [f'{m} -> {t}' for m, ts in graph().items() if not m.endswith('_modidx') and m != 'capskip'
          for t in ts if layer(t) > layer(m)]
    assert not up, up


def test_docs_and_testing_are_outside_the_library():
    "Only the command layer reaches the docs builder; only notebooks and tests (and commands) use capskip.testing."
    users = {t: sorted(m for m, ts in graph().items() if any(x == t or x.startswith(t + '.') for x in ts)
                       and not (m == t or m.startswith(t + '.')))
             for t in ('capskip._docs', 'capskip.testing')}
    assert all(m.startswith('capskip.cli') for m in users['capskip._docs']), users
    assert all(m.startswith('capskip.cli') for m in users['capskip.testing']), users


def test_no_private_names_cross_modules():
    mods = modules()
    bad = [f'{m}: from {t} import {n}' for m, f in mods.items() if not m.endswith('_modidx')
           for t, names in imports(m, f) if t.startswith('capskip') and t != m
           for n in names if n.startswith('_') and not n.startswith('__')]
    assert not bad, bad


def code_lines(path: Path) -> int:
    return sum(1 for l in path.read_text(encoding='utf-8').splitlines() if l.strip() and not l.strip().startswith('#'))


def test_no_module_over_400_lines_of_code():
    big = {m: code_lines(f) for m, f in modules().items() if not m.endswith('_modidx') and code_lines(f) > 400}
    assert not big, big


def test_every_module_comes_from_an_existing_notebook():
    for m, f in modules().items():
        if m in ('capskip', 'capskip._modidx'): continue
        head = f.read_text(encoding='utf-8')[:600]
        assert 'AUTOGENERATED! DO NOT EDIT! File to edit:' in head, f'{f} was not exported from a notebook'
        nb = head.split('File to edit: ', 1)[1].split('.ipynb', 1)[0] + '.ipynb'
        assert (f.parent / nb).resolve().exists(), f'{f} comes from {nb}, which no longer exists (a stale module?)'


def test_public_api_is_explicit():
    assert capskip.__all__ == sorted(capskip.__all__)
    for name in capskip.__all__:
        assert getattr(capskip, name) is not None, name
        assert name in dir(capskip)
    for name in ('CAPSkip', 'select', 'Selection', 'StepStats', 'first_violation', 'batchnorm_to_groupnorm', 'Engine'):
        assert name in capskip.__all__
    with pytest.raises(AttributeError): capskip.not_a_name


def test_names_other_code_calls_keep_working():
    from capskip.selector import residuals, select, select_reference
    from capskip.engine import Engine
    from capskip.policies import create_policy
    assert callable(capskip.CAPSkip) and all(map(callable, (residuals, select, select_reference, Engine, create_policy)))


# ---------------------------------------------------------------- notebooks show their results
OUTPUT_NOTEBOOKS = sorted([*(ROOT / 'nbs').glob('0*.ipynb'), *(ROOT / 'nbs' / 'tutorials').glob('*.ipynb')])


@pytest.mark.parametrize('nb', OUTPUT_NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_with_outputs(nb):
    cells = json.loads(nb.read_text(encoding='utf-8'))['cells']
    shown = [c for c in cells if c['cell_type'] == 'code' and c.get('outputs')]
    runnable = [c for c in cells if c['cell_type'] == 'code' and not ''.join(c['source']).lstrip().startswith(('#| export', '#| default_exp', '#| hide', '#|export'))]
    assert not runnable or shown, f'{nb.name} has no saved outputs: run `python tools/run_nbs.py {nb.relative_to(ROOT)}`'
    errors = [o for c in cells for o in c.get('outputs', []) if o.get('output_type') == 'error']
    assert not errors, f'{nb.name} was saved with an error output'
