"""flashtile/_source.py: the kernel functions' source lines as inspect gives them, without the tokenizer."""
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import shutil

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


def _digest_of(root, name):
    """package_digest() of the package copy at root (its _source module loaded from there, under another name)."""
    spec = importlib.util.spec_from_file_location(name, root / "_source.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.package_digest()


def test_package_digest_tells_trees_apart(tmp_path):
    # What `python -m flashtile bench` records (flashtile_sources): a copy of the package digests the same, a copy
    # with one changed file does not.
    package = pathlib.Path(_source.__file__).parent
    copy = tmp_path / "flashtile"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert _digest_of(copy, "_source_copy_a") == _source.package_digest()
    kernel = copy / "kernels" / "hopper_bwd.py"
    kernel.write_text(kernel.read_text() + "\n# changed\n")
    assert _digest_of(copy, "_source_copy_b") != _source.package_digest()
