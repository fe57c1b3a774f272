__version__ = "0.1.0"

# The only hand-written module (nbdev's package marker): everything else is exported from nbs/.
# The public API, resolved lazily so that `import capskip` and `capskip --help` stay fast (no torch import).
_API = {
    # the rule (capskip.selector) and the shared math (capskip.core)
    'select': 'capskip.selector', 'residuals': 'capskip.selector', 'Selection': 'capskip.selector',
    'select_reference': 'capskip.selector', 'first_violation': 'capskip.selector',
    'magnitude_budget': 'capskip.selector', 'last_layer_grad': 'capskip.selector',
    'DEFAULT_BUDGET': 'capskip.core',
    # execution (capskip.engine)
    'Engine': 'capskip.engine', 'RowDependenceError': 'capskip.engine', 'HeadError': 'capskip.engine',
    # the door for your own loop (capskip.skip) and one step's statistics (capskip.steps)
    'CAPSkip': 'capskip.skip', 'SkipOptions': 'capskip.skip', 'StepStats': 'capskip.steps',
    # policies (capskip.policies)
    'create_policy': 'capskip.policies', 'list_policies': 'capskip.policies',
    # models and data for runs (capskip.runs)
    'create_model': 'capskip.runs.models', 'list_models': 'capskip.runs.models',
    'batchnorm_to_groupnorm': 'capskip.runs.models', 'create_splits': 'capskip.runs.data',
}
__all__ = sorted(_API)


def __getattr__(name):
    if name in _API:
        import importlib
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'capskip' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
