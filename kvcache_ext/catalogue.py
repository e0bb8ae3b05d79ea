"""The op catalogue: each op declared once, its three Python forms and its fake derived from that.

An op is declared by one decorated function (``kvcache_ext/ops.py``, ``kivi_ops.py``, ``linear.py``)::

    @op(globals(), kernels=NATIVE, reference=append_to_slots)
    def append_kv(k_cache, v_cache, k_new, v_new, lengths, new_counts=None) -> None:
        \"\"\"The public docstring.\"\"\"
        ...  # the checks, composed of the shared per-kind checks; changes nothing

Its signature is the op's (the same names and defaults as its schema in ``csrc/ops.cpp``, compared
when the native library is loaded), its docstring the public one, its body every check. From it and
the decorator's data :func:`op` derives, into the declaring module:

* ``check_X``: the body (raises ``ValueError``/``TypeError``, returns None, changes nothing);
* ``run_X``: no check; the kernel ``torch.ops.kvcache_ext.X`` where ``kernels`` says one serves the
  device of the op's first buffer (the first argument, or the second after ``q``), decided once at
  import, else ``reference`` (python_ref's implementation, called with the op's arguments; an
  attention's as :class:`Attention` says);
* ``X``: ``check_X`` then ``run_X`` (looked up in the module at each call, so that a patched ``run_X``
  is the one run), the function the package exports;
* the fake (``torch.library.register_fake``): all tensors on one device, then ``outputs`` of the
  arguments by name (None: the op writes in place and returns nothing).

An op the loaded library has no schema for (one whose kernel is still to come) runs its reference
everywhere and has no fake; ``kernels`` claiming a device for it is an error at import.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from . import _native
from .capabilities import capabilities

CATALOGUE: dict[str, Op] = {}


@dataclass(frozen=True)
class Op:
    """One catalogue entry: the op's name, signature and checks (the declared function), the devices
    its kernels serve (``(cpu, cuda)``), its reference and the rule for its fake outputs."""

    name: str
    check: Callable
    kernels: tuple[bool, bool]
    reference: Callable
    outputs: Callable | None

    @property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.check)


def served(test: Callable) -> tuple[bool, bool]:
    """``(cpu, cuda)``: whether the native kernels of each device pass ``test(capabilities(device))``."""
    return tuple(bool(capabilities(device).native and test(capabilities(device))) for device in ("cpu", "cuda"))


@dataclass(frozen=True)
class Attention:
    """The output rule of an attention op: ``(out, lse)``, ``out`` ``(B, H_q, T, value width)`` in q's
    dtype, the width that of the argument named ``width`` (an int, or a tensor's last dimension), and
    ``lse`` ``(B, H_q, T)`` float32. Its reference is called with the op's arguments up to ``scale``
    by position, ``return_lse=True`` and the others by name; its lse is returned in float32."""

    width: str

    def __call__(self, arguments: dict):  # the fake's outputs
        q, value = arguments["q"], arguments[self.width]
        value = value.shape[3] if isinstance(value, torch.Tensor) else value
        B, H_q, T, _ = q.shape
        return q.new_empty((B, H_q, T, value)), q.new_empty((B, H_q, T), dtype=torch.float32)

    def reference(self, reference: Callable, names: list[str]) -> Callable:
        split = names.index("scale") + 1

        def run(*args):
            out, lse = reference(*args[:split], return_lse=True, **dict(zip(names[split:], args[split:])))
            return out, lse.float()

        return run


def check_one_device(*tensors) -> None:
    # A raw op called with one meta tensor among CPU tensors dispatches to the fake kernel;
    # it must refuse like the real kernels do instead of returning as if it had run.
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise RuntimeError(f"kvcache_ext ops need all tensors on one device, got {sorted(map(str, devices))}")


def op(namespace: dict, kernels: tuple[bool, bool], reference: Callable, outputs: Callable | None = None):
    """Declares the decorated function's op in the catalogue and puts its ``check_X`` and ``run_X`` into
    ``namespace`` (the declaring module's globals); returns ``X``."""

    def declare(check):
        name = check.__name__
        signature = inspect.signature(check)
        entry = CATALOGUE[name] = Op(name, check, kernels, reference, outputs)
        complete = _completer(signature)
        if isinstance(outputs, Attention):
            reference_run = outputs.reference(reference, list(signature.parameters))
        else:
            reference_run = reference
        schema = _native.available and hasattr(torch.ops.kvcache_ext, name)
        if any(kernels) and not schema:
            raise ImportError(f"kvcache_ext: {name} is declared with kernels {kernels} but has no schema")
        kernel = _kernel(entry) if schema else None
        buffer = 1 if next(iter(signature.parameters)) == "q" else 0
        sinks = list(signature.parameters).index("sinks") if "sinks" in signature.parameters else None
        cpu, cuda = kernels
        count = len(signature.parameters)

        def run(*args, **kwargs):
            if kwargs or len(args) != count:
                args = complete(args, kwargs)
            device_of = args[buffer]
            if (device_of.is_cpu and cpu) or (device_of.is_cuda and cuda):
                if sinks is not None and args[sinks] is not None:  # the schemas take float32 sinks
                    args = (*args[:sinks], args[sinks].float(), *args[sinks + 1 :])
                return kernel(*args)
            return reference_run(*args)

        run_name = f"run_{name}"

        def checked(*args, **kwargs):
            check(*args, **kwargs)
            return namespace[run_name](*args, **kwargs)

        for form, form_name, doc in (
            (run, run_name, f":func:`{name}` on arguments that passed :func:`check_{name}`."),
            (checked, name, check.__doc__),
        ):
            functools.update_wrapper(form, check)
            form.__name__ = form.__qualname__ = form_name
            form.__doc__ = doc
        namespace[run_name] = run
        namespace[f"check_{name}"] = check
        check.__name__ = check.__qualname__ = f"check_{name}"
        check.__doc__ = f"Every check :func:`{name}` makes of its arguments; changes nothing."
        if schema:
            torch.library.register_fake(f"kvcache_ext::{name}")(_fake(signature, complete, outputs))
        return checked

    return declare


def _completer(signature: inspect.Signature) -> Callable:
    """A function turning a call's ``(args, kwargs)`` into every argument by position, defaults filled in."""
    parameters = list(signature.parameters.values())
    defaults = tuple(p.default for p in parameters)
    required = sum(p.default is inspect.Parameter.empty for p in parameters)

    def complete(args: tuple, kwargs: dict) -> tuple:
        if kwargs or not required <= len(args) <= len(parameters):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return tuple(bound.arguments.values())
        return args + defaults[len(args) :]

    return complete


def _kernel(entry: Op) -> Callable:
    """The op's overload, its schema's argument names and defaults checked against the declaration."""
    overload = getattr(torch.ops.kvcache_ext, entry.name).default
    schema = [(a.name, a.default_value if a.has_default_value() else "-") for a in overload._schema.arguments]
    declared = [(p.name, "-" if p.default is p.empty else p.default) for p in entry.signature.parameters.values()]
    if schema != declared:
        raise ImportError(f"kvcache_ext: {entry.name}'s declaration {declared} is not its schema's {schema}")
    return overload


def _fake(signature: inspect.Signature, complete: Callable, outputs: Callable | None) -> Callable:
    def fake(*args, **kwargs):
        args = complete(args, kwargs)
        check_one_device(*args)
        return None if outputs is None else outputs(dict(zip(signature.parameters, args)))

    return fake
