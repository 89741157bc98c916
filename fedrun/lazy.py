"""torch, imported when first used while the ``fedrun`` command checks a config: ``from fedrun.lazy import torch``.

A run's config is checked by building every part (their constructors refuse a bad value in one line naming its key,
``fedrun.cli.build.build_parts``) before anything trains. Those constructors never touch torch, but their modules
name it, and ``import torch`` costs 1.3-1.9 s of an idle two-core machine: a typo in ``aggregator.temperature``
would wait for it (issue 53). So the command defers torch (``defer``) before it imports the part modules, builds
them, and ends the deferral (``load``) before anything else runs; a refusal in between answers without torch.
Outside the command (a notebook, a test, a worker process) nothing is deferred: ``torch`` here is torch, imported.

Deferring is the standard library's recipe (``importlib.util.LazyLoader``, "Implementing lazy imports" in the
``importlib`` docs): ``sys.modules["torch"]`` is a module that imports itself on its first attribute read and then
is the ``torch`` module (every ``from fedrun.lazy import torch`` holds that same object). Its rules, kept here:

- A module-level use of torch (a class base, a decorator, a default value, an annotation evaluated at import) imports
  it at once. The part modules use ``from __future__ import annotations`` and keep torch inside functions;
  ``fedrun.models`` and ``fedrun.optimizers`` subclass torch's classes, so the modules a part needs take them from
  ``deferrable`` (imported on first use while deferred). ``tests/config/test_lazy_torch.py`` builds every option of
  every group with torch deferred and checks it stayed unimported.
- A dotted import of a submodule (``import torch.distributed``) while torch is deferred would import that submodule
  twice (the import system reads ``torch.__path__``, which imports torch and its submodules, then loads the
  submodule again; for ``torch.distributed`` the process aborts): the modules ``build_parts`` imports name torch's
  submodules as attributes (``torch.nn.functional``; ``fedrun.distributed`` and ``fedrun.vmap`` are imported only
  after ``load``), and code that is not fedrun's (a part or trainer class of the user's, a node whose targets are
  unknown) is imported only after ``load`` (``fedrun.cli.build.build``, ``fedrun.backends.findable``). The command
  ends the deferral once the parts are built, or when building them fails in a process that goes on.
- On Python < 3.12 ``LazyLoader`` is not thread-safe: ``load`` runs on the main thread before any other starts.
- Where the interpreter's ``LazyLoader`` cannot load a module that reads its own attributes while it runs, nothing is
  deferred (``defer`` imports at once, so a refusal waits for torch's import). CPython's thread-safe lazy loading
  (gh-114763, in 3.12.3 and 3.11.9) ran such a read through the load again until the stack overflowed (gh-117178, a
  RecursionError from every ``fedrun`` run, seen on an H200 machine's Python 3.12.3); which patch releases carry the
  mend (3.12.4 on) is asked of the interpreter itself (``lazy_loading_works``), not read from its version number.
"""

import functools
import importlib
import importlib.abc
import importlib.util
import sys
import types

_deferred: set[str] = set()


def defer(name: str) -> types.ModuleType:
    """Register ``name`` to import on its first attribute read (unless it is imported already); returns it."""
    if name in sys.modules:
        return sys.modules[name]
    if not lazy_loading_works():
        return importlib.import_module(name)
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    if parent:  # as the import system does: ``fedrun.models`` is an attribute of ``fedrun``
        setattr(sys.modules[parent], child, module)
    _deferred.add(name)
    return module


def deferred(name: str) -> bool:
    """Whether ``name`` is registered and not imported yet."""
    return name in _deferred and name in sys.modules and isinstance(sys.modules[name], _LAZY)


def load(name: str) -> types.ModuleType:
    """``name``, imported now (ending its deferral)."""
    module = importlib.import_module(name)  # on a deferred module: reads its __spec__, which imports it
    getattr(module, "__name__")  # noqa: B009 (an attribute read is what imports a deferred module)
    return module


def deferrable(name: str) -> types.ModuleType:
    """The module ``name``: imported now, or on its first use while torch is deferred."""
    return defer(name) if deferred("torch") else importlib.import_module(name)


class _SelfReading(importlib.abc.Loader):
    """A module whose code reads one of its own attributes through the module object, as torch's does."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.value = 1
        module.read = module.value  # on a lazily loaded module: a read while it loads


@functools.cache
def lazy_loading_works() -> bool:
    """Whether ``importlib.util.LazyLoader`` loads a module that reads its own attributes while it runs (not so on
    CPython 3.12.3, gh-117178: the read starts the load again, to a RecursionError)."""
    name = f"{__name__}._self_reading_probe"
    spec = importlib.util.spec_from_loader(name, importlib.util.LazyLoader(_SelfReading()))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        return module.read == 1
    except RecursionError:
        return False
    finally:
        sys.modules.pop(name, None)


_LAZY = importlib.util._LazyModule  # the class of a registered module until its first attribute read


def __getattr__(name: str):
    """``from fedrun.lazy import torch``: the deferred torch while the command defers it, else torch, imported. Read
    by each importing module when it is imported (PEP 562), so importing this module imports nothing."""
    if name == "torch":
        return sys.modules["torch"] if "torch" in sys.modules else importlib.import_module("torch")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
