"""scripts/speculators_compare.py as a module for the tests that run speculators' loaders
(scripts/ is not a package)."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

DRIVER = Path(__file__).resolve().parents[1] / "scripts" / "speculators_compare.py"


@functools.cache  # one module object for every test that asks
def driver():
    spec = importlib.util.spec_from_file_location("speculators_compare", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
