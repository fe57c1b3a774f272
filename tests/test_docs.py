"""The docs site: `capskip docs` builds it offline from nbs/, and headless Chromium finds every page working.

One session fixture builds the real site from nbs/ with stored outputs (`--no-execute`: the suite already runs every
notebook through nbdev_test) and loads every page in Debian's Chromium; a small scratch project checks the default
build (`capskip docs --check`: a notebook stored without outputs is executed — outputs, plots, skipped test flags —
and one committed with outputs is rendered as stored) and the error path. Chromium missing is a failure.
"""
import json
import re
import shutil
from pathlib import Path

import pytest

from capskip._docs.build import DocsBuildError, build_site, find_pages, read_settings, site_url
from capskip._docs.check import check_site, find_chromium, public_api, site_pages
from capskip.cli.tools import docs_main as main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='session')
def built(tmp_path_factory):
    find_chromium()  # fails (not skips) with the install command when Chromium is missing
    tmp = tmp_path_factory.mktemp('docs')
    report = build_site(ROOT, out=tmp / 'site', work=tmp / 'work', execute=False, progress=False)
    return report


@pytest.fixture(scope='session')
def seen(built):
    return check_site(built.out)


def test_every_notebook_has_a_page(built):
    pages = find_pages(ROOT / 'nbs')
    assert pages[0].name == 'index' and len(built.pages) >= len(pages) - 2  # (other notebooks may appear meanwhile)
    html = site_pages(built.out)
    missing = [p for p in built.pages if f'{p}.html' not in html]
    assert not missing, f'notebooks without a page: {missing}'
    assert {'search.html', 'genindex.html'} <= set(html)


def test_sphinx_build_has_no_warnings(built):
    assert built.warnings == [], 'Sphinx warnings:\n' + '\n'.join(built.warnings)


def test_pages_load_without_console_errors(seen):
    assert len(seen.pages) >= 3
    assert seen.console_errors == [], '\n'.join(seen.console_errors)
    assert seen.failed_requests == [], '\n'.join(seen.failed_requests)


def test_no_request_leaves_the_machine(seen):
    assert seen.external_requests == [], '\n'.join(seen.external_requests)


def test_math_is_rendered_by_the_local_mathjax(built, seen):
    with_math = {p: v for p, v in seen.math.items() if v[0]}
    assert 'selector.html' in with_math, 'the derivation notebook should have math'
    assert seen.math_problems() == [], '\n'.join(seen.math_problems())
    page = (built.out / 'selector.html').read_text(encoding='utf-8')
    assert re.search(r'<script[^>]+src="_static/mathjax/tex-chtml\.js', page)
    assert 'cdn.jsdelivr' not in page and 'mathjax@' not in page


def test_search_finds_select(seen):
    assert seen.search_hits, 'searching "select" on search.html returned nothing'
    assert any(h.startswith('selector.html') for h in seen.search_hits), seen.search_hits


def test_every_public_function_and_class_has_an_api_entry(seen):
    api = public_api()
    assert sum(map(len, api.values())) > 10
    missing = [f'{mod}.{name}' for mod, names in api.items() for name in names if name not in seen.api_entries]
    assert not missing, f'public objects without a show_doc entry on any page: {missing}'


def test_sidebar_follows_notebook_order(built, seen):
    expected = [f'{p}.html' for p in built.pages if p != 'index']
    assert built.pages[0] == 'index' and len(expected) >= 3
    assert seen.sidebar == expected


def test_links_stay_on_the_site(built):
    url = site_url(read_settings(ROOT))
    leaking = [p for p in site_pages(built.out) if f'href="{url}' in (built.out / p).read_text(encoding='utf-8')]
    assert not leaking, f'pages linking to the published site instead of themselves: {leaking}'


# --- the executing build, on a scratch project -------------------------------------------------------------------

def _nb(cells):
    "Cells as (kind, source) or, for a code cell with a stored output, ('code', source, printed text)."
    out = []
    for i, (kind, src, *stored) in enumerate(cells):
        cell = {'cell_type': kind, 'id': f'c{i}', 'metadata': {}, 'source': src}
        if kind == 'code':
            outputs = [{'output_type': 'stream', 'name': 'stdout', 'text': text} for text in stored]
            cell.update(outputs=outputs, execution_count=1 if stored else None)
        out.append(cell)
    return {'cells': out, 'metadata': {'kernelspec': {'display_name': 'python3', 'language': 'python', 'name': 'python3'}},
            'nbformat': 4, 'nbformat_minor': 5}


def _project(tmp: Path, extra: dict | None = None) -> Path:
    shutil.copy(ROOT / 'settings.ini', tmp / 'settings.ini')
    (tmp / 'capskip').mkdir()
    shutil.copytree(ROOT / 'docs' / '_assets', tmp / 'docs' / '_assets')
    nbs = tmp / 'nbs'
    notebooks = {
        'index.ipynb': [('markdown', '# Scratch\n\n> A scratch project.\n\nSee [the maths](00_maths.ipynb).')],
        '00_maths.ipynb': [
            ('code', '#| default_exp maths'),
            ('markdown', '# Maths\n\n> Sums.\n\nProse in the title cell: $\\sum_i g_i$.\n\n::: {.callout-note}\nA note.\n:::'),
            ('code', '#| hide\nfrom nbdev.showdoc import show_doc'),
            ('code', '#| export\ndef total(xs: list) -> float:\n    "Sum of `xs`."\n    return float(sum(xs))'),
            ('code', 'print("total is", total([1, 2, 3.5]))'),
            ('code', '#| echo: false\nprint("quiet" + "-input")'),
            ('code', '#| notest\nraise RuntimeError("a notest cell must not run")'),
            ('code', 'import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(2, 2)); ax.plot([0, 1], [1, 0]); plt.show()'),
        ],
        'tutorials/01_walk.ipynb': [('markdown', '# A walk\n\n> Tutorial.'), ('code', 'print(6 * 7)')],
        'tutorials/02_stored.ipynb': [('markdown', '# Stored\n\n> Committed with outputs.'),
                                      ('code', 'print("fresh" + "-run")', 'stored-output 7\n'),
                                      ('code', 'raise RuntimeError("a committed notebook must not be re-run")', 'was fine\n')],
    }
    for rel, cells in {**notebooks, **(extra or {})}.items():
        (nbs / rel).parent.mkdir(parents=True, exist_ok=True)
        (nbs / rel).write_text(json.dumps(_nb(cells)))
    return tmp


def test_capskip_docs_executes_notebooks_and_checks_the_site(tmp_path, monkeypatch, capsys):
    root = _project(tmp_path)
    monkeypatch.chdir(root / 'nbs')
    assert main(['--check', '--search', 'total']) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert 'preview: python -m http.server -d' in out and 'no problems' in out
    site = root / 'docs'
    maths = (site / 'maths.html').read_text(encoding='utf-8')
    assert 'total is 6.5' in maths                                # executed, output kept
    assert 'quiet-input' in maths and 'quiet" + "-input' not in maths  # echo: false hides the code only
    assert 'a notest cell must not run' in maths and 'Traceback' not in maths  # shown, not run (else the build fails)
    assert re.search(r'<img[^>]+src="_images/[^"]+\.png"', maths)   # the plot
    assert 'Prose in the title cell' in maths                     # not lost with the title cell
    assert 'admonition note' in maths                             # Quarto callout as an admonition
    assert 'data-qualname="total"' in maths                       # show_doc entry added for the export
    assert 'href="maths.html"' in (site / 'index.html').read_text(encoding='utf-8')
    assert '42' in (site / 'tutorials' / 'walk.html').read_text(encoding='utf-8')
    stored = (site / 'tutorials' / 'stored.html').read_text(encoding='utf-8')
    assert 'stored-output 7' in stored and 'was fine' in stored       # committed outputs rendered as they are
    assert 'fresh-run' not in stored and 'Traceback' not in stored    # ... and the notebook was not executed
    assert '(4 notebooks processed, 3 of them executed' in out
    assert (site / '.capskip-docs').exists() and (site / '_assets' / 'mathjax').exists()


def test_execute_and_no_execute_override_stored_outputs(tmp_path, capsys):
    root = _project(tmp_path)
    with pytest.raises(DocsBuildError, match=r'02_stored\.ipynb(?s:.*)must not be re-run'):
        build_site(root, out=tmp_path / 'site', execute=True, progress=False)
    report = build_site(root, out=tmp_path / 'site', execute=False, progress=False)
    assert report.executed == 0 and report.processed == 4
    maths = (tmp_path / 'site' / 'maths.html').read_text(encoding='utf-8')
    assert 'data-qualname="total"' in maths and 'total is 6.5' not in maths   # API entries only, no outputs


def test_a_failing_notebook_is_named(tmp_path):
    root = _project(tmp_path, {'05_broken.ipynb': [('markdown', '# Broken\n\n> Fails.'), ('code', '1 / 0')]})
    with pytest.raises(DocsBuildError, match=r'05_broken\.ipynb.*(?s:.*)ZeroDivisionError'):
        build_site(root, out=tmp_path / 'site', execute=True, progress=False)
    assert not (tmp_path / 'site').exists()


def test_missing_chromium_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match='apt-get install'):
        find_chromium('/nonexistent/chromium')
