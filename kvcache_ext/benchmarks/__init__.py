"""The benchmark suites: every performance claim of kvcache_ext is measured here.

Three pytest-benchmark suites, each parametrised by implementation so that the native op and its
alternatives land in one group:

* ``append``            one new token into a cache holding L tokens: native in-place append,
                        the article's ``torch.cat`` cache, python_ref's preallocated cache
* ``decode_attention``  one query per row over a full cache: native, ``reference_attention``,
                        ``scaled_dot_product_attention``; GB/s and fraction of copy bandwidth
* ``generation``        GPT-2 greedy generation with every cache; tokens/s for prefill,
                        decode and overall

They live in the installed package so that ``kvcache-ext bench`` can run them anywhere; the
repository's ``bench/test_bench_*.py`` are thin wrappers so that ``pytest`` runs them too. The
modules are not named ``test_*.py`` so that ``pytest <repository>`` does not collect them a second
time, without their plugin. ``plugin`` is the pytest plugin they need (mode, device, timing,
copy bandwidth) and ``report`` turns the pytest-benchmark JSON into a Markdown summary and plots.

Modes: ``quick`` (default) uses tiny sizes and a few rounds so the suites run with the tests and
never rot; its numbers mean nothing. ``full`` uses the sizes of the performance targets:
``pytest bench --bench-mode=full`` (or ``KVCACHE_EXT_BENCH=full pytest bench``), or
``kvcache-ext bench``.
"""
