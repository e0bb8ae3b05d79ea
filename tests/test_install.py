"""The installed package: what was built, that it loads under the running torch, and (opt-in)
that a wheel built with pip's build isolation is abi3 and works in a fresh environment."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata

import pytest
import torch

import kvcache_ext


def version_tuple(text):
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2])


def test_build_info_describes_the_build_and_the_running_torch():
    info = kvcache_ext.build_info()
    assert info["torch_running"] == torch.__version__
    assert version_tuple(info["torch_running"]) >= version_tuple(info["torch_min_supported"])
    assert info["native_loaded"] == kvcache_ext.native_available()
    if info["native_loaded"]:
        assert info["cpu_isa_active"] in info["cpu_isas_compiled"]


@pytest.mark.skipif(os.environ.get("KVCACHE_EXT_REQUIRE_NATIVE") != "1", reason="native code not required here")
def test_native_code_is_what_runs():
    assert kvcache_ext.native_available(), kvcache_ext.build_info()


@pytest.mark.skipif(
    not (sys.platform == "linux" and shutil.which("readelf") and shutil.which("nm") and kvcache_ext.native_available()),
    reason="needs Linux, binutils and the native library",
)
def test_native_libraries_use_the_shared_libstdcxx():
    # A compiler with only a static libstdc++ links a private copy into the library, whose
    # iostreams, mixed with the shared one torch loads, lose or crash every error message that
    # formats a number (setup.py links the shared one by name then).
    package_dir = os.path.dirname(kvcache_ext.__file__)
    libraries = [os.path.join(package_dir, f) for f in os.listdir(package_dir) if f.endswith(".so")]
    assert libraries
    for library in libraries:
        dynamic = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
        assert "[libstdc++.so.6]" in dynamic, f"{library} does not load the shared libstdc++"
        defined = subprocess.run(["nm", "-C", "--defined-only", library], capture_output=True, text=True).stdout
        assert "std::ostream::_M_insert<long>(long)" not in defined, f"{library} holds a copy of libstdc++'s iostreams"


def installed_distribution():
    """kvcache_ext's installed distribution, or None where it is an editable (development) install."""
    distribution = metadata.distribution("kvcache_ext")
    direct_url = json.loads(distribution.read_text("direct_url.json") or "{}")
    return None if direct_url.get("dir_info", {}).get("editable") else distribution


@pytest.mark.skipif(installed_distribution() is None, reason="an editable install: no wheel was installed")
def test_the_installed_wheel_is_abi3_and_carries_the_library_and_the_licenses():
    # What `pip install .` installed came from the wheel its isolated build made (README's command
    # in CI): its tag and file list are that wheel's.
    distribution = installed_distribution()
    tags = [
        line.split(":", 1)[1].strip()
        for line in distribution.read_text("WHEEL").splitlines()
        if line.startswith("Tag:")
    ]
    assert tags and all("-abi3-" in tag for tag in tags), tags
    names = [str(path) for path in distribution.files]
    assert any(name.startswith("kvcache_ext/_C.abi3") for name in names), names
    assert "python_ref/assets/gpt2.tiktoken.LICENSE" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") or name.endswith(".dist-info/LICENSE") for name in names)
    # ... and it is what this process imports, not a source tree beside it.
    assert os.path.realpath(kvcache_ext.__file__) == os.path.realpath(
        distribution.locate_file("kvcache_ext/__init__.py")
    )


SMOKE = textwrap.dedent("""
    import torch, kvcache_ext
    from python_ref import build_gpt2, generate, ConcatCache
    model = build_gpt2("tiny", seed=0)
    prompt = torch.tensor([[1, 2, 3]])
    cache = kvcache_ext.KVCache(**model.kv_shape, batch_size=1, max_cache_len=16)
    assert torch.equal(generate(model, prompt, 10, cache=cache), generate(model, prompt, 10, cache=ConcatCache()))
    print({**kvcache_ext.build_info(), "package_dir": kvcache_ext.__file__})
""")


@pytest.mark.skipif(
    os.environ.get("KVCACHE_EXT_WHEEL_TEST") != "1",
    reason="builds a wheel in an isolated environment (minutes); set KVCACHE_EXT_WHEEL_TEST=1",
)
def test_isolated_wheel_is_abi3_and_works_in_a_fresh_environment(tmp_path):
    source = os.environ.get("KVCACHE_EXT_SOURCE", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "dist"), source], check=True
    )
    wheel = next((tmp_path / "dist").glob("kvcache_ext-*.whl"))
    assert "-abi3-" in wheel.name, wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert any(name.startswith("kvcache_ext/_C.abi3") for name in names)
    # The licenses travel with the code: ours, and the GPT-2 ranks file's own.
    assert "python_ref/assets/gpt2.tiktoken.LICENSE" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") or name.endswith(".dist-info/LICENSE") for name in names)
    # A fresh environment that sees this one's packages (its torch, whatever version that is)
    # only after its own, so the wheel's kvcache_ext and python_ref are the ones imported.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    own_site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run([python, "-m", "pip", "install", "--no-deps", str(wheel)], check=True)
    parent_site = os.path.dirname(os.path.dirname(torch.__file__))
    with open(os.path.join(own_site, "parent_environment.pth"), "w") as pth:  # after pip: it must not see ours
        pth.write(parent_site + "\n")
    result = subprocess.run(
        [python, "-c", SMOKE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "KVCACHE_EXT_REQUIRE_NATIVE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "'native_loaded': True" in result.stdout
    assert f"'package_dir': '{own_site}" in result.stdout
