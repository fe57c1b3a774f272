__version__ = "0.1.0"

# The only hand-written module (nbdev's package marker): everything else is exported from nbs/.
# Public names resolve lazily so that `import capskip` and `capskip --help` stay fast.
_LAZY = {'CAPSkip': 'capskip.policies', 'create_policy': 'capskip.policies', 'list_policies': 'capskip.policies',
         'select': 'capskip.selector', 'residuals': 'capskip.selector', 'Engine': 'capskip.engine',
         'create_model': 'capskip.models', 'list_models': 'capskip.models'}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'capskip' has no attribute {name!r}")
