"""Execute notebooks top to bottom and save their outputs in place (a maintainers' helper).

Usage: python tools/run_nbs.py [--skip-flags notest] NB.ipynb [NB.ipynb ...]

Tutorials and derivation notebooks are committed with the outputs of a quiet run, so that a reader on GitHub,
in JupyterLab or on the docs site sees results, and the docs render them instead of re-timing anything on the
build machine. Cells flagged with a skip flag (settings.ini `tst_flags`, e.g. `#| notest`) and `#| eval: false`
cells are not run (their stored outputs are cleared). Run `nbdev_clean --fname NB` afterwards (it keeps outputs,
removes execution counts and metadata). A notebook whose execution raises is left unchanged and the command exits 1.
"""
import argparse, json, os, sys, time
from pathlib import Path

from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell


def _directives(src: str) -> dict:
    out = {}
    for line in src.splitlines():
        if not line.startswith('#|'): break
        words = line[2:].split()
        if words: out[words[0]] = words[1:]
    return out


def run_one(path: Path, skip_flags: set[str]) -> bool:
    nb = read_nb(path)
    def skip(cell):
        if cell.cell_type != 'code': return True
        d = _directives(cell.source)
        return bool(skip_flags & d.keys()) or d.get('eval:', [''])[0].lower() == 'false'
    for cell in nb.cells:
        if cell.cell_type == 'code':
            cell.outputs = []; cell.execution_count = None
    os.environ['IN_TEST'] = '1'
    shell = CaptureShell(path)
    start, cwd = time.time(), os.getcwd()
    try:
        os.chdir(path.parent)
        shell.run_all(nb, exc_stop=True, preproc=skip)
    except BaseException:
        sys.stderr.write(shell.prettytb(fname=path) + '\n')
        return False
    finally:
        os.chdir(cwd)
    write_nb(nb, path)
    print(f'{path}: {time.time() - start:.1f} s')
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('notebooks', nargs='+', type=Path)
    parser.add_argument('--skip-flags', default='', help='comma-separated cell flags not to run (e.g. notest)')
    ns = parser.parse_args(argv)
    flags = {f for f in ns.skip_flags.split(',') if f}
    ok = [run_one(p.resolve(), flags) for p in ns.notebooks]
    return 0 if all(ok) else 1


if __name__ == '__main__':
    sys.exit(main())
