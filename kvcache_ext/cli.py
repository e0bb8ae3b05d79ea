"""The `kvcache-ext` command: `generate`, `chat`, `serve`, `demo`, `bench`, `info` and `disk-tier`.

Its parser imports no torch (nor does ``import kvcache_ext``), so ``--help`` and a wrong argument
answer at once; a subcommand's handler imports the modules it runs.
"""

from __future__ import annotations

import argparse
import sys

from . import bench, chat_command, demo_options, generate_command, serve_command


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" to an option's help, unless the help already says what its default
    is or the default is "absent" (None, an unset flag): those options' help says what absence means."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, built from torch-free modules: `--help` and wrong arguments answer without
    importing torch, which each subcommand's handler imports when it runs."""
    parser = argparse.ArgumentParser(
        prog="kvcache-ext", description="KV-cache extension for PyTorch LLM decoding", formatter_class=HelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_subcommand(
        commands,
        "generate",
        generate_command.add_arguments,
        run_generate,
        help="continue a prompt with a Hugging Face checkpoint (the text alone on stdout)",
        description="Load a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) and "
        "continue --prompt, greedy unless --temperature is given. Only the generated text goes to stdout, "
        "as it is decoded; load time, prompt and decode tokens/s and KV bytes go to stderr.",
    )
    add_subcommand(
        commands,
        "chat",
        chat_command.add_arguments,
        run_chat,
        help="a conversation with a Hugging Face checkpoint (turns reuse the earlier turns' keys and values)",
        description="Talk to a Hugging Face model directory through its chat template, one line a turn "
        "(/exit or end of input quits). The Engine's paged prefix cache keeps the conversation's blocks, so "
        "each turn computes only its new tokens.",
    )
    add_subcommand(
        commands,
        "serve",
        serve_command.add_arguments,
        run_serve,
        help="an OpenAI-compatible HTTP server on a Hugging Face checkpoint",
        description="Serve a Hugging Face model directory over the OpenAI API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics) by one Engine on a paged KV cache with prefix "
        "caching and, with --disk-tier, a prefix cache that survives restarts. SIGTERM or SIGINT: running "
        "requests get a grace period, the prefix cache is written back, exit 0.",
    )
    add_subcommand(
        commands,
        "demo",
        demo_options.add_arguments,
        run_demo,
        help="the article's experiment with every cache (random weights: it measures the caches, not the text)",
        description="Generate from one prompt with every cache (none, torch.cat, preallocated, native), "
        "check that all give the same tokens and print their speed and KV memory. The model's weights are "
        "random (seeded) unless --weights names a GPT-2 checkpoint, so the text is not meant to read well.",
    )
    add_subcommand(
        commands,
        "bench",
        bench.add_arguments,
        bench.run,
        help="run the benchmark suites; write JSON, a summary and plots",
    )
    add_subcommand(
        commands,
        "info",
        info_arguments,
        info,
        help="what the native extension was built with, what runs, what it supports",
        description="What was built (torch, CPU kernel copies, CUDA), what runs here and the capability "
        "table of each device, as a table.",
    )
    add_subcommand(
        commands,
        "disk-tier",
        disk_tier_arguments,
        disk_tier,
        help="what a prefix cache's disk tier directory holds; clear it",
        description="Count the block files of a disk tier directory (PagedKVCache(disk_tier=...)) by "
        "fingerprint, format version and layout, read from each file's metadata; or remove them all.",
    )
    commands.metavar = "{" + ",".join(commands.choices) + "}"  # what a missing subcommand's error names
    return parser


def add_subcommand(commands, name, add_arguments, run, help, description=None) -> None:
    """Register subcommand ``name``: ``add_arguments(parser)`` declares its options and must not import
    torch; ``run(args)`` runs it (importing what it needs) and returns the exit status."""
    subparser = commands.add_parser(name, help=help, description=description, formatter_class=HelpFormatter)
    add_arguments(subparser)
    subparser.set_defaults(run=run)


def run_generate(args) -> int:
    return generate_command.run(args)


def run_chat(args) -> int:
    return chat_command.run(args)


def run_serve(args) -> int:
    return serve_command.run(args)


def run_demo(args) -> int:
    from . import demo

    return demo.run(args)


def info_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the raw form instead: build_info() and every capability field (default: off, the table)",
    )


def disk_tier_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=existing_directory, help="the disk tier's directory")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (default: off, text)")
    parser.add_argument(
        "--clear",
        action="store_true",
        help="remove every block file and partial file instead (nothing else in the directory; default: off)",
    )


def existing_directory(text: str) -> str:
    import os

    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


def info_json() -> dict:
    """``build_info()`` and, per device, every field of ``capabilities(device)`` (dtypes as names)."""
    import kvcache_ext

    report = kvcache_ext.build_info()
    report["capabilities"] = {}
    for device in ("cpu", "cuda"):
        table = kvcache_ext.capabilities(device)
        report["capabilities"][device] = {
            **vars(table),
            "dtypes": [str(d).removeprefix("torch.") for d in table.dtypes],
        }
    return report


def info_table() -> str:
    """What ``kvcache-ext info`` prints: the build, what runs, and the capability table in words."""
    import kvcache_ext
    from kvcache_ext.capabilities import LIMIT_TITLES, readable_limits

    built = kvcache_ext.build_info()
    compiled = ", ".join(built.get("cpu_isas_compiled", [])) or "unknown"
    if built["native_loaded"]:
        cpu = f"loaded; running the {built['cpu_isa_active']} copy of the kernels (compiled: {compiled})"
    else:
        cpu = f"not loaded, the pure-PyTorch fallback runs: {built['native_unavailable_reason']}"
    if built["cuda_loaded"]:
        cuda = f"loaded (compiled for {', '.join(built['cuda_archs'])})"
    elif built.get("cuda"):
        cuda = f"built for {', '.join(built['cuda_archs'])}, not loaded: {built['cuda_unavailable_reason']}"
    else:
        cuda = f"not built ({built['cuda_unavailable_reason']})"
    facts = [
        ("torch running", built["torch_running"]),
        (
            "built against torch",
            f"{built.get('torch_built_against', 'unknown')} (loads under torch >= "
            f"{built.get('torch_min_supported', 'unknown')})",
        ),
        ("CPU library", cpu),
        ("CUDA library", cuda),
    ]
    lines = ["kvcache_ext: what was built and what runs", ""]
    width = max(len(title) for title, _ in facts)
    lines += [f"  {title:<{width}}  {value}" for title, value in facts]

    devices = ("cpu", "cuda")
    columns = {device: readable_limits(kvcache_ext.capabilities(device)) for device in devices}
    titles = {key: title.replace("`", "") for key, title in LIMIT_TITLES.items()}
    width = max(len(title) for title in titles.values())
    column_width = {device: max(len(value) for value in columns[device].values()) for device in devices}
    lines += ["", "What the kernels accept, per device:", ""]
    rows = [
        ("", {device: device for device in devices}),
        *((title, {d: columns[d][key] for d in devices}) for key, title in titles.items()),
    ]
    for title, cells in rows:
        lines.append(f"  {title:<{width}}  " + "  ".join(f"{cells[d]:<{column_width[d]}}" for d in devices).rstrip())
    return "\n".join(lines)


def info(args) -> int:
    if args.json:
        import json

        print(json.dumps(info_json(), indent=2))
    else:
        print(info_table())
    return 0


def disk_tier(args) -> int:
    from .prefix_tiers import clear_directory, inspect_directory

    if args.clear:
        removed, freed = clear_directory(args.directory)
        print(f"removed {removed} files ({freed} bytes) from {args.directory}")
        return 0
    report = inspect_directory(args.directory)
    if args.json:
        import json

        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{report['directory']}: {report['files']} block files, {report['bytes']} bytes "
        f"({report['unreadable']} unreadable, {report['partial']} partial)"
    )
    for group in report["groups"]:
        print(
            f"  fingerprint {group['fingerprint']!r}, format {group['format_version']}, {group['dtype']} "
            f"kv_dtype {group['kv_dtype']}, blocks of {group['block_size']}, {group['kv_heads']} heads x "
            f"{group['head_dim']}, {group['num_layers']} layers: {group['files']} files, {group['bytes']} bytes"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
