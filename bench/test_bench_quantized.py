"""pytest entry point of the suite shipped as kvcache_ext.benchmarks.quantized (see there)."""

from kvcache_ext.benchmarks.quantized import *  # noqa: F401,F403  (the test and its fixtures, by name)
