"""pytest entry point of the suite shipped as kvcache_ext.benchmarks.tensor_parallel (see there).

The file name differs from tests/'s: both folders are rootless, so basenames must be unique.
"""

from kvcache_ext.benchmarks.tensor_parallel import *  # noqa: F401,F403  (the test, by name)
