"""Write a notebook from a plain-text cell list (a maintainers' helper; notebooks stay the source).

Usage: python tools/nbwrite.py SRC.py OUT.ipynb

SRC.py holds cells separated by lines `# %% [markdown]` or `# %%` (jupytext's percent
format). Markdown lines carry a leading `# ` (or a lone `#` for a blank line), which is removed. This keeps long notebooks writable as text; the
notebook written is the source of truth that nbdev exports, tests and documents.
"""
import hashlib, json, re, sys
from pathlib import Path


def cells_from_text(text: str) -> list[dict]:
    parts = re.split(r'^# %%( \[markdown\])?[ \t]*\n', text, flags=re.M)
    cells, kind = [], 'code'
    # re.split with a group yields [pre, g1, body1, g2, body2, ...]
    pre, rest = parts[0], parts[1:]
    if pre.strip(): cells.append(('code', pre))
    for marker, body in zip(rest[0::2], rest[1::2]):
        cells.append(('markdown' if marker else 'code', body))
    out = []
    for kind, body in cells:
        body = body.strip('\n')
        if not body.strip(): continue
        src = body.splitlines(keepends=True)
        if kind == 'markdown':
            src = [re.sub(r'^# ?', '', l) for l in src]
            out.append({'cell_type': 'markdown', 'metadata': {}, 'source': src})
        else:
            out.append({'cell_type': 'code', 'execution_count': None, 'metadata': {}, 'outputs': [], 'source': src})
    for i, cell in enumerate(out):  # stable ids: exports and diffs stay reproducible
        cell['id'] = hashlib.sha1(f'{i}:{"".join(cell["source"])}'.encode()).hexdigest()[:8]
    return out


def write_notebook(src: Path, dst: Path) -> None:
    nb = {'cells': cells_from_text(Path(src).read_text()),
          'metadata': {'kernelspec': {'display_name': 'python3', 'language': 'python', 'name': 'python3'}},
          'nbformat': 4, 'nbformat_minor': 5}
    Path(dst).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')


if __name__ == '__main__':
    write_notebook(Path(sys.argv[1]), Path(sys.argv[2]))
