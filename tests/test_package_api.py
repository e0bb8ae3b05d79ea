"""The package's names: importing kvcache_ext imports no torch, and each public name comes from its
module on first use, as the import statements of the package's source say."""

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import kvcache_ext
from child_python import run_python

ROOT = Path(__file__).resolve().parents[1]


def run_python_code(code):
    run = run_python("-c", code)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def declared_imports() -> dict[str, str]:
    """Each name the package's source imports for readers (type checkers, the API docs), with its module."""
    tree = ast.parse((ROOT / "kvcache_ext" / "__init__.py").read_text())
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names.update({alias.asname or alias.name: node.module for alias in node.names})
    return names


def test_importing_the_package_lists_its_names_without_importing_torch():
    torch_imported, names_listed = run_python_code(
        "import sys, kvcache_ext; print('torch' in sys.modules, set(kvcache_ext.__all__) <= set(dir(kvcache_ext)))"
    )
    assert (torch_imported, names_listed) == ("False", "True")


def test_each_public_name_is_the_object_its_module_defines():
    declared = declared_imports()
    assert sorted(declared) == sorted(kvcache_ext.__all__)
    for name, module in declared.items():
        assert getattr(kvcache_ext, name) is getattr(importlib.import_module(f"kvcache_ext.{module}"), name), name


def test_capabilities_stays_the_function_when_a_module_importing_its_module_comes_first():
    # kvcache_ext.storage imports the module kvcache_ext.capabilities before anything asked for the function.
    assert run_python_code(
        "import kvcache_ext.storage, kvcache_ext\n"
        "from kvcache_ext import capabilities\n"
        "print(capabilities is kvcache_ext.capabilities, kvcache_ext.capabilities('cpu').device_type)"
    ) == ["True", "cpu"]


def names_imported_from_the_package(text: str) -> set[str]:
    found = set()
    for match in re.finditer(r"^\s*from kvcache_ext import (\([^)]*\)|[^\n]*)", text, re.MULTILINE):
        names = re.sub(r"#[^\n]*", "", match.group(1)).strip().strip("()")  # comments out
        found |= {name.split(" as ")[0].strip() for name in names.split(",")} - {""}
    return found


def test_every_name_the_repository_imports_from_the_package_resolves():
    files = [ROOT / "README.md"]
    for folder in ("tests", "bench", "examples", "docs", "tools"):
        files += [path for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".md")]
    imported = set().union(*(names_imported_from_the_package(path.read_text()) for path in files))
    assert {"KVCache", "Engine", "capabilities", "ops"} <= imported  # the search finds them
    unresolved = [
        name
        for name in sorted(imported)
        if not hasattr(kvcache_ext, name) and importlib.util.find_spec(f"kvcache_ext.{name}") is None
    ]
    assert not unresolved
