"""Packaging for capskip, driven by settings.ini (nbdev's classic template, without pkg_resources)."""
import shlex
from configparser import ConfigParser

import setuptools

config = ConfigParser(delimiters=['='])
config.read('settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

for key in 'version description keywords author author_email'.split():
    assert key in cfg, f'settings.ini is missing `{key}`'

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.10 3.11 3.12 3.13'.split()

requirements = shlex.split(cfg.get('requirements', ''))
dev_requirements = shlex.split(cfg.get('dev_requirements', ''))
docs_requirements = shlex.split(cfg.get('docs_requirements', ''))
# framework integrations (capskip.integrations): optional for users, installed for the tests
integrations = {name: shlex.split(cfg.get(f'{name}_requirements', '')) for name in ('lightning', 'accelerate', 'hf')}
lic = licenses[cfg['license']]
min_python = cfg['min_python']
console_scripts = cfg.get('console_scripts', '').split()

setuptools.setup(
    name=cfg['lib_name'],
    license=lic[0],
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])],
                 'Intended Audience :: ' + cfg['audience'].title(),
                 'License :: ' + lic[1],
                 'Natural Language :: ' + cfg['language'].title()]
                + ['Programming Language :: Python :: ' + v for v in py_versions[py_versions.index(min_python):]],
    url=cfg['git_url'],
    packages=setuptools.find_packages(include=['capskip', 'capskip.*']),
    include_package_data=True,
    package_data={'capskip': ['data/*']},
    install_requires=requirements,
    extras_require={'dev': dev_requirements + docs_requirements + sum(integrations.values(), []), 'docs': docs_requirements,
                    **integrations},
    dependency_links=cfg.get('dep_links', '').split(),
    python_requires='>=' + cfg['min_python'],
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    zip_safe=False,
    entry_points={'console_scripts': console_scripts, 'nbdev': [f'{cfg["lib_path"]}={cfg["lib_path"]}._modidx:d']},
    version=cfg['version'],
    description=cfg['description'],
    keywords=cfg['keywords'],
    author=cfg['author'],
    author_email=cfg['author_email'],
)
