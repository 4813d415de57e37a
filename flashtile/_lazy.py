"""Modules imported on first use rather than with flashtile.

The kernel modules (flashtile.kernels.*) import Triton and define their kernels when imported: 0.4-0.6 s on top of
`import torch` (docs/design-record.md, "Import: the kernels on first use"). `import flashtile` imports none of them;
the modules that call into them (dispatch, kvcache) hold a `LazyModule` in their place, and the first call that needs
a kernel module imports it. Nothing is compiled then either: Triton compiles a kernel at its first launch.
"""
import importlib
import importlib.util
import types

from ._source import kernel_sources


class LazyModule(types.ModuleType):
    """Stands in for a module, bound to a global name of the module that uses it, until one of its attributes is
    first read or set: it then imports the module, binds that name to the module itself (so every later read is a
    plain module attribute read, at no cost per call), and answers from it.

    A ModuleType, so that torch.compile treats it as the module it stands for. A name bound elsewhere (`from x import
    lazy`) keeps the stand-in, which still answers, by one more attribute lookup.
    """

    def __init__(self, name, namespace):
        super().__init__(name)
        self.__dict__["_LazyModule__namespace"] = namespace

    def _load(self):
        with kernel_sources():  # (flashtile/_source.py)
            module = importlib.import_module(self.__name__)
        namespace = self.__namespace
        for key, value in list(namespace.items()):
            if value is self:
                namespace[key] = module
        return module

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)  # copy, pickle and inspect probing the stand-in itself import nothing
        return getattr(self._load(), attr)

    def __setattr__(self, attr, value):
        setattr(self._load(), attr, value)

    def __delattr__(self, attr):
        delattr(self._load(), attr)

    def __repr__(self):
        return f"<module {self.__name__!r} (imported on first use)>"


def lazy_module(name, namespace):
    """A LazyModule for `name` (relative names resolve against namespace's package), to be bound in `namespace`
    (the caller's globals()): `configs = lazy_module(".kernels.configs", globals())`."""
    if name.startswith("."):
        name = importlib.util.resolve_name(name, namespace["__package__"])
    return LazyModule(name, namespace)
