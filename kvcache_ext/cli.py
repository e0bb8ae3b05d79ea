"""The `kvcache-ext` command."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvcache-ext", description="KV-cache extension for PyTorch LLM decoding")
    commands = parser.add_subparsers(dest="command", required=True)

    from . import demo

    demo_parser = commands.add_parser("demo", help="the article's experiment with every cache")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)

    from . import bench

    bench_parser = commands.add_parser("bench", help="run the benchmark suites; write JSON, a summary and plots")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=bench.run)

    info_parser = commands.add_parser(
        "info", help="what the native extension was built with, what runs, what it supports"
    )
    info_parser.set_defaults(run=_info)

    args = parser.parse_args(argv)
    return args.run(args)


def _info(_args) -> int:
    import json

    import kvcache_ext

    info = kvcache_ext.build_info()
    info["capabilities"] = {}
    for device in ("cpu", "cuda"):
        table = kvcache_ext.capabilities(device)
        info["capabilities"][device] = {**vars(table), "dtypes": [str(d).removeprefix("torch.") for d in table.dtypes]}
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
