"""The benchmark suites' pytest plugin (kvcache_ext/benchmarks/plugin.py), for `pytest bench`.

Quick mode (default, part of the normal `pytest` run): tiny sizes, no speed claims; pyproject.toml's
addopts pass --benchmark-disable, so there each benchmark runs once, untimed (no tables), and
`pytest bench --benchmark-enable` times a few rounds. Full mode: `pytest bench --bench-mode=full
--benchmark-enable` or `KVCACHE_EXT_BENCH=full pytest bench --benchmark-enable`; or `kvcache-ext
bench`, which ignores the repository's pytest settings and also writes the JSON, a Markdown summary
and plots.
"""

import pytest

# The suites are package modules, not test files: ask for pytest's assertion messages anyway.
pytest.register_assert_rewrite("kvcache_ext.benchmarks")

from kvcache_ext.benchmarks.plugin import *  # noqa: E402,F401,F403  (hooks and fixtures, by name)
