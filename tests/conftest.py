"""Test-session settings: property tests draw the same examples on every CI run (derandomised), and explore freely elsewhere."""
import os

from hypothesis import settings

settings.register_profile('ci', derandomize=True, print_blob=True)
if os.environ.get('CI'):
    settings.load_profile('ci')
