"""pytest entry point of the suite shipped as kvcache_ext.benchmarks.generation (see there).

The suites live in the package so that `kvcache-ext bench` runs them from any install. (The
file name differs from tests/'s: both folders are rootless, so basenames must be unique.)
"""

from kvcache_ext.benchmarks.generation import *  # noqa: F401,F403  (the test and its fixtures, by name)
