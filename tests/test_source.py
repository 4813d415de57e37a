"""flashtile/_source.py: the kernel functions' source lines as inspect gives them, without the tokenizer."""
import importlib
import inspect
import pkgutil

import flashtile.kernels
from flashtile import _source


def _kernel_functions():
    """Every function of flashtile.kernels' modules that a @triton.jit / @gluon.jit object wraps (its `fn`)."""
    found = {}
    for info in pkgutil.iter_modules(flashtile.kernels.__path__):
        module = importlib.import_module(f"flashtile.kernels.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if inspect.isfunction(fn) and fn.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = fn
    return found


def test_kernel_functions_read_as_inspect_reads_them():
    functions = _kernel_functions()
    # The forward's and backward's kernels and their helpers at least (more under Gluon).
    assert len(functions) >= 40, sorted(functions)
    assert inspect.getsourcelines is _source._original  # (not inside kernel_sources here)
    for name, fn in functions.items():
        assert _source.getsourcelines(fn) == inspect.getsourcelines(fn), name


def _outside(x):  # a function outside the package: kernel_sources leaves it to inspect
    return x + 1


def test_kernel_sources_is_scoped_and_reentrant():
    original = inspect.getsourcelines
    expected = original(_outside)
    with _source.kernel_sources():
        assert inspect.getsourcelines is not original
        with _source.kernel_sources():
            assert inspect.getsourcelines(_outside) == expected
        assert inspect.getsourcelines is not original  # (the outer one still holds)
        assert _source.getsourcelines(_outside) is None
    assert inspect.getsourcelines is original


def test_lambdas_go_to_inspect():
    from flashtile.kernels import _common  # (any module of the package)
    namespace = {}
    # A lambda whose code names a file of the package, at its line 1 (the module's docstring, no def there).
    exec(compile("f = lambda x: x", _common.__file__, "exec"), namespace)
    assert namespace["f"].__code__.co_filename == _common.__file__
    assert _source.getsourcelines(namespace["f"]) is None
    assert _source.getsourcelines(_source.getsourcelines) == inspect.getsourcelines(_source.getsourcelines)
