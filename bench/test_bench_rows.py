"""pytest entry point of the suite shipped as kvcache_ext.benchmarks.rows (see there)."""

from kvcache_ext.benchmarks.rows import *  # noqa: F401,F403  (the tests and their fixtures, by name)
