"""torch, imported when first used while the ``fedrun`` command checks a config: ``from fedrun.lazy import torch``.

A run's config is checked by building every part (their constructors refuse a bad value in one line naming its key,
``fedrun.cli.build.build_parts``) before anything trains. Those constructors never touch torch, but their modules
name it, and ``import torch`` costs 1.3-1.9 s of an idle two-core machine: a typo in ``aggregator.temperature``
would wait for it (issue 53). So the command defers torch (``defer``) before it imports the part modules, builds
them, and ends the deferral (``load``) before anything else runs; a refusal in between answers without torch.
Outside the command (a notebook, a test, a worker process) nothing is deferred: ``torch`` here is torch, imported.

Deferring is the recipe of the standard library's ``importlib.util.LazyLoader`` ("Implementing lazy imports" in the
``importlib`` docs) as CPython wrote it up to 3.11.8 and 3.12.2: ``sys.modules["torch"]`` is a module that imports
itself into the same object on its first attribute read (every ``from fedrun.lazy import torch`` holds it). It is
written here (``_Deferred``) because the standard library's own no longer loads torch: its thread-safe rewrite
(gh-114763; CPython 3.11.9, 3.12.3 and 3.13 on) keeps the module lazy while its code runs, and ``torch/__init__.py``
deletes one of its own attributes then (``delattr(sys.modules[__name__], "TensorBase")``), which that class's
``__delattr__`` passes back to itself until the stack overflows: every ``fedrun`` run died in a RecursionError on
Python 3.12.3 and 3.13 (seen on the H200 machine's 3.12.3 and this machine's 3.13.0; 3.11.7 here hid it). Its rules,
kept here:

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
- Not thread-safe (as the recipe was before 3.12.3): ``load`` runs on the main thread before any other starts.
"""

import importlib
import importlib.util
import sys
import types

_deferred: set[str] = set()


def defer(name: str) -> types.ModuleType:
    """Register ``name`` to import on its first attribute read (unless it is imported already); returns it."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader_state = {"__dict__": dict(module.__dict__)}  # what the module holds before its code runs
    module.__class__ = _Deferred
    parent, _, child = name.rpartition(".")
    if parent:  # as the import system does: ``fedrun.models`` is an attribute of ``fedrun``
        setattr(sys.modules[parent], child, module)
    _deferred.add(name)
    return module


def deferred(name: str) -> bool:
    """Whether ``name`` is registered and not imported yet."""
    return name in _deferred and name in sys.modules and isinstance(sys.modules[name], _Deferred)


def load(name: str) -> types.ModuleType:
    """``name``, imported now (ending its deferral)."""
    module = importlib.import_module(name)  # on a deferred module: reads its __spec__, which imports it
    getattr(module, "__name__")  # noqa: B009 (an attribute read is what imports a deferred module)
    return module


def deferrable(name: str) -> types.ModuleType:
    """The module ``name``: imported now, or on its first use while torch is deferred."""
    return defer(name) if deferred("torch") else importlib.import_module(name)


class _Deferred(types.ModuleType):
    """A registered module until its first attribute read or deletion, which runs its code in this same object."""

    def __getattribute__(self, attr):
        self.__class__ = types.ModuleType  # from here on a plain module: its own code reads and deletes as usual
        spec = self.__spec__
        before = spec.loader_state["__dict__"]
        # what was set on it while deferred (an imported submodule, say) is set again after its code, as an eager
        # import would leave it
        updated = {k: v for k, v in self.__dict__.items() if k not in before or before[k] is not v}
        spec.loader.exec_module(self)
        if sys.modules.get(spec.name, self) is not self:
            raise ValueError(f"module object for {spec.name!r} substituted in sys.modules during a lazy load")
        self.__dict__.update(updated)
        return getattr(self, attr)

    def __delattr__(self, attr):
        self.__getattribute__(attr)  # loads it (and raises if there is no such attribute)
        delattr(self, attr)


def __getattr__(name: str):
    """``from fedrun.lazy import torch``: the deferred torch while the command defers it, else torch, imported. Read
    by each importing module when it is imported (PEP 562), so importing this module imports nothing."""
    if name == "torch":
        return sys.modules["torch"] if "torch" in sys.modules else importlib.import_module("torch")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
