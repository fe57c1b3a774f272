"""The docs site: `capskip docs` builds it offline from nbs/, and headless Chromium finds every page working.

A background thread (started by `conftest.py` once the tests are collected) builds the real site from nbs/ with stored outputs (`--no-execute`: the suite already runs every
notebook, in tests/test_notebooks_rerun.py) and loads every page in a local Chrome/Chromium (`find_chromium`); a small scratch
project checks the default build (`capskip docs --check`: a notebook stored without outputs is executed — outputs,
plots, skipped test flags — and one committed with outputs is rendered as stored) and the error path.

No browser is a failure with one line saying what to do, never a silent skip; only CAPSKIP_SKIP_BROWSER_CHECK=1
skips the browser tests, and then a warning in pytest's summary says so. The browser lookup and `.ci/system-deps`
(find a browser, install Debian's only where apt and root exist, otherwise say what to do) are tested here too.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import capskip._docs.check as docs_check
from capskip._docs.build import DocsBuildError, build_site, find_pages, read_settings, site_url
from capskip._docs.check import CHROMIUM_ENV, NO_BROWSER, SKIP_BROWSER_ENV, check_site, find_chromium, public_api, site_pages
from capskip.cli.tools import docs_main as main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='session')
def browser():
    "The browser for the checks; fails (not skips) with what to do when there is none, unless the user opted out."
    if os.environ.get(SKIP_BROWSER_ENV) == '1':
        why = f'{SKIP_BROWSER_ENV}=1: the docs BROWSER CHECK WAS SKIPPED (not run, not passed)'
        warnings.warn(why, UserWarning)
        pytest.skip(why)
    return find_chromium()


_SITE: dict = {}   # 'future': the background build and browser check, 'tmp': its folder


def _build_and_check(tmp: Path) -> tuple:
    "The real site built from nbs/ with stored outputs, and what Chromium saw on its pages (None: no check asked for)."
    report = build_site(ROOT, out=tmp / 'site', work=tmp / 'work', execute=False, progress=False)
    if os.environ.get(SKIP_BROWSER_ENV) == '1': return report, None
    try: browser = find_chromium()
    except FileNotFoundError: return report, None   # the `browser` fixture fails with what to do
    return report, check_site(report.out, browser)


def start_site() -> None:
    """Build the site and load its pages in a background thread, once: `conftest.py` starts it as soon as the tests are
    collected (the build's workers, Sphinx and Chromium are subprocesses), so the other tests go on meanwhile."""
    if _SITE: return
    _SITE['tmp'] = Path(tempfile.mkdtemp(prefix='capskip-docs-'))
    _SITE['future'] = ThreadPoolExecutor(1, thread_name_prefix='docs').submit(_build_and_check, _SITE['tmp'])


def stop_site() -> None:
    "Remove the background build's folder (after the session)."
    if _SITE and _SITE['future'].done(): shutil.rmtree(_SITE['tmp'], ignore_errors=True)


@pytest.fixture(scope='session')
def built():
    start_site()
    return _SITE['future'].result()[0]


@pytest.fixture(scope='session')
def seen(built, browser):
    start_site()
    return _SITE['future'].result()[1]


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


def test_sidebar_reads_as_a_book(built, seen):
    "Tutorials first, then the method's pages, the framework integrations, experiments, command line, API reference, and the internals last."
    names = [h[:-len('.html')] for h in seen.sidebar]
    first = lambda prefix: next(i for i, n in enumerate(names) if n.startswith(prefix))
    assert names[:2] == ['tutorials/quickstart', 'tutorials/cancellation'], names[:5]
    assert max(i for i, n in enumerate(names) if n.startswith('tutorials/')) < names.index('selector')
    assert names.index('selector') < names.index('engine') < names.index('policies') < names.index('runs') < first('cli')
    assert first('cli') < names.index('core') < names.index('estimate') < names.index('docs') < names.index('testing'), names
    home = (built.out / 'index.html').read_text(encoding='utf-8')
    captions = re.findall(r'<p class="caption" role="heading"><span class="caption-text">([^<]+)</span>', home)
    assert captions[:4] == ['Tutorials', 'The method', 'Use it with your framework', 'Experiments'], captions
    assert captions[-1].startswith('Internals'), captions
    assert names.index('policies') < names.index('lightning') < names.index('hf') < names.index('runs'), names


def _ids_and_links(site: Path) -> tuple[dict, list]:
    ids, links = {}, []
    for rel in site_pages(site):
        html = (site / rel).read_text(encoding='utf-8')
        ids[rel] = set(re.findall(r'\bid="([^"]+)"', html))
        links += [(rel, h) for h in re.findall(r'href="([^"#:]*\.html)#([^"]+)"', html)]
    return ids, links


def test_api_links_reach_their_anchor(built):
    "Every link to an API entry (`page.html#name.with.dots`) reaches an element with that id on that page."
    import posixpath
    ids, links = _ids_and_links(built.out)
    broken = []
    for page, (target, frag) in links:
        if '.' not in frag: continue
        path = posixpath.normpath(posixpath.join(posixpath.dirname(page), target))
        if path in ids and frag not in ids[path]: broken.append(f'{page}: {target}#{frag}')
    assert not broken, f'{len(broken)} links to missing anchors: {sorted(set(broken))[:20]}'


def test_source_links_open_the_file_inside_the_site(built):
    "Every API entry's source link is a highlighted copy of the package file in the site, at the entry's line."
    import posixpath
    found = 0
    for rel in site_pages(built.out):
        for href in re.findall(r'class="capskip-source" href="([^"]+)"', (built.out / rel).read_text(encoding='utf-8')):
            assert not href.startswith('http'), f'{rel}: source link leaves the site: {href}'
            path, _, frag = href.partition('#')
            target = built.out / posixpath.normpath(posixpath.join(posixpath.dirname(rel), path))
            assert target.is_file(), f'{rel}: {href} is not in the site'
            assert frag.startswith('L-') and f'id="{frag}"' in target.read_text(encoding='utf-8'), f'{rel}: {href}'
            found += 1
    assert found > 50


def test_long_output_lines_wrap(built):
    css = (built.out / '_static' / 'capskip.css').read_text()
    assert re.search(r'\.cell_output pre \{[^}]*white-space: pre-wrap', css), css


def _show_doc_notebooks() -> list[str]:
    "Every notebook with a `show_doc` cell (all re-run since the renderer came in)."
    out = []
    for path in sorted((ROOT / 'nbs').glob('*.ipynb')):
        nb = json.loads(path.read_text())
        if any(c['cell_type'] == 'code' and ''.join(c['source']).lstrip().startswith('show_doc(') for c in nb['cells']):
            out.append(path.name)
    return out

OWN_RERUN = _show_doc_notebooks()


@pytest.mark.parametrize('rel', OWN_RERUN)
def test_stored_show_doc_outputs_are_plain_markdown(rel):
    """Stored `show_doc` outputs carry a plain relative source link (`capskip._docs.showdoc.SourceRenderer`), never the
    Pandoc `{target="_blank" ...}` attributes JupyterLab shows as text nor the placeholder repository. Checked on the
    notebooks re-run since the renderer came in; the others change when they are next re-run (tools/run_nbs.py)."""
    nb = json.loads((ROOT / 'nbs' / rel).read_text())
    outs = [''.join(o['data']['text/markdown']) for c in nb['cells'] if c['cell_type'] == 'code'
            and ''.join(c['source']).lstrip().startswith('show_doc(') for o in c.get('outputs', []) if 'text/markdown' in o.get('data', {})]
    assert outs, f'{rel} has no stored show_doc output'
    bad = [o[:120] for o in outs if '{target=' in o or 'github.com' in o]
    assert not bad, bad
    assert any(re.search(r'\[source\]\((\.\./)+capskip/[\w/]+\.py#L\d+\)', o) for o in outs)


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


def test_capskip_docs_executes_notebooks_and_checks_the_site(tmp_path, monkeypatch, capsys, browser):
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


def _fake_browser(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / name
    exe.write_text('#!/bin/sh\nexit 0\n'); exe.chmod(0o755)
    return exe


def test_browser_lookup_order(tmp_path, monkeypatch):
    "Explicit path, then $CAPSKIP_CHROMIUM, then the usual paths, then PATH; nothing found is one line saying what to do."
    usual, on_path = _fake_browser(tmp_path / 'opt', 'chrome'), _fake_browser(tmp_path / 'bin', 'google-chrome')
    monkeypatch.setattr(docs_check, 'CHROMIUM_PATHS', (str(tmp_path / 'missing'), str(usual)))
    env = {'PATH': str(tmp_path / 'bin')}
    assert find_chromium(environ=env) == str(usual)
    assert find_chromium(environ={**env, CHROMIUM_ENV: str(on_path)}) == str(on_path)
    assert find_chromium(str(usual), environ={**env, CHROMIUM_ENV: str(on_path)}) == str(usual)
    monkeypatch.setattr(docs_check, 'CHROMIUM_PATHS', ())
    assert find_chromium(environ=env) == str(on_path)               # a laptop or cluster node: Chrome on PATH
    with pytest.raises(FileNotFoundError) as exc:
        find_chromium(environ={'PATH': str(tmp_path / 'empty')})
    assert str(exc.value) == NO_BROWSER and '\n' not in NO_BROWSER
    assert CHROMIUM_ENV in NO_BROWSER and SKIP_BROWSER_ENV in NO_BROWSER
    with pytest.raises(FileNotFoundError, match=r'\$CAPSKIP_CHROMIUM'):   # a wrong explicit choice is not overridden
        find_chromium(environ={**env, CHROMIUM_ENV: str(tmp_path / 'typo')})


def test_docs_check_without_a_browser_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(docs_check, 'find_chromium', lambda path=None: (_ for _ in ()).throw(FileNotFoundError(NO_BROWSER)))
    monkeypatch.setattr('capskip.cli.tools.check_site', lambda site, **kw: docs_check.check_site(site, **kw))
    (tmp_path / 'site').mkdir(); (tmp_path / 'site' / 'index.html').write_text('<html></html>')
    monkeypatch.setattr('capskip.cli.tools.build_site', lambda **kw: type('R', (), dict(
        out=tmp_path / 'site', warnings=[], pages=['index'], seconds=0.0, processed=0, executed=0, cached=0))())
    assert main(['--check']) == 1
    err = capsys.readouterr().err
    assert err.strip() == f'capskip docs: {NO_BROWSER}' and 'Traceback' not in err


def _hide_browsers() -> str:
    "Shell commands hiding every browser on the lookup's absolute paths inside a private mount namespace."
    hide = [p for p in docs_check.CHROMIUM_PATHS if os.path.exists(p)]
    return ' && '.join(f'mount --bind /dev/null {p!r}' for p in hide) or 'true'


@pytest.mark.parametrize('case', ['root-without-apt', 'apt-without-root'])
def test_system_deps_without_a_browser_says_what_to_do(case, tmp_path):
    """Off Debian/root the README's test command must not stop: one line saying what to do, exit 0, apt never tried
    without root (the browser test then fails with the same line). The browsers on the usual paths are hidden in a
    private mount namespace and PATH holds only python and `id`; 'apt-without-root' adds a recording apt-get, an `id`
    answering uid 1000 and a sudo that needs a password."""
    if sys.platform != 'linux' or os.geteuid() != 0 or not shutil.which('unshare'):
        pytest.skip('hiding the browsers needs root and unshare (Linux); this machine cannot simulate a browserless one')
    probe = subprocess.run(['unshare', '-m', 'true'], capture_output=True)
    if probe.returncode != 0: pytest.skip(f'unshare -m is not permitted here: {probe.stderr.decode().strip()}')
    fake = tmp_path / 'bin'
    fake.mkdir()
    (fake / 'python').symlink_to(sys.executable)
    (fake / 'id').symlink_to(shutil.which('id'))
    if case == 'apt-without-root':
        (fake / 'id').unlink()
        for name, body in (('id', 'echo 1000'), ('sudo', 'exit 1'), ('apt-get', f'touch {tmp_path}/apt-ran')):
            (fake / name).write_text(f'#!/bin/sh\n{body}\n'); (fake / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in (CHROMIUM_ENV, SKIP_BROWSER_ENV)}
    script = f'{_hide_browsers()} && PATH={fake} {shutil.which("bash")} {ROOT}/.ci/system-deps'
    out = subprocess.run(['unshare', '-m', 'bash', '-c', script], capture_output=True, text=True, env=env, timeout=120)
    lines = [l for l in (out.stdout + out.stderr).splitlines() if l.strip()]
    assert out.returncode == 0, out
    assert lines == [f'system-deps: {NO_BROWSER}'], lines
    assert not (tmp_path / 'apt-ran').exists()


def test_system_deps_says_it_installs_chromium_before_apt_runs(tmp_path):
    """As root with apt and no browser, one line (naming the size and CAPSKIP_CHROMIUM) comes before apt-get runs.
    apt-get is a fake that records its arguments and whether the announcement was already on stderr."""
    if sys.platform != 'linux' or os.geteuid() != 0 or not shutil.which('unshare'):
        pytest.skip('hiding the browsers needs root and unshare (Linux); this machine cannot simulate a browserless one')
    probe = subprocess.run(['unshare', '-m', 'true'], capture_output=True)
    if probe.returncode != 0: pytest.skip(f'unshare -m is not permitted here: {probe.stderr.decode().strip()}')
    fake, err = tmp_path / 'bin', tmp_path / 'stderr.txt'
    fake.mkdir()
    (fake / 'python').symlink_to(sys.executable)
    (fake / 'id').symlink_to(shutil.which('id'))
    (fake / 'apt-get').write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/apt-ran\n{shutil.which("cat")} {err} >> {tmp_path}/seen-before-apt\n')
    (fake / 'apt-get').chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in (CHROMIUM_ENV, SKIP_BROWSER_ENV)}
    script = f'{_hide_browsers()} && PATH={fake} {shutil.which("bash")} {ROOT}/.ci/system-deps 2> {err}'
    out = subprocess.run(['unshare', '-m', 'bash', '-c', script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out
    assert (tmp_path / 'apt-ran').read_text().splitlines()[-1].startswith('install -y -q --no-install-recommends chromium')
    seen = (tmp_path / 'seen-before-apt').read_text()
    assert 'installing Debian\'s chromium with apt-get' in seen and 'CAPSKIP_CHROMIUM=' in seen, seen


def test_system_deps_finds_the_browser_and_reports_an_opt_out_loudly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (CHROMIUM_ENV, SKIP_BROWSER_ENV)}
    env['PATH'] = f'{Path(sys.executable).parent}:{env.get("PATH", "")}'
    exe = _fake_browser(tmp_path, 'chrome')
    out = subprocess.run(['bash', str(ROOT / '.ci' / 'system-deps')], capture_output=True, text=True,
                         env={**env, CHROMIUM_ENV: str(exe)})
    assert (out.returncode, out.stdout.strip()) == (0, f'system-deps: docs browser check uses {exe}')
    out = subprocess.run(['bash', str(ROOT / '.ci' / 'system-deps')], capture_output=True, text=True,
                         env={**env, SKIP_BROWSER_ENV: '1'})
    assert out.returncode == 0 and 'SKIPPED' in out.stderr
