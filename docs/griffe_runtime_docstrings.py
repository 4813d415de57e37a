"""A griffe extension for the API reference (mkdocs.yml): the public functions complete their docstrings when
flashtile is imported (flashtile.interface shares the argument descriptions through "{args}" placeholders), so the
reference reads those functions' docstrings from the live objects. Everything else stays static analysis, which
imports nothing (inspecting the whole package would import flashtile.bench.__main__, which runs the benchmark)."""
import importlib
import inspect

import griffe


class RuntimeDocstrings(griffe.Extension):
    def on_function(self, *, func, loader, **kwargs):
        if func.docstring is None or "{args}" not in func.docstring.value:
            return
        live = getattr(importlib.import_module(func.module.path), func.name, None)
        if live is not None and live.__doc__:
            func.docstring = griffe.Docstring(inspect.cleandoc(live.__doc__), lineno=func.docstring.lineno,
                                              endlineno=func.docstring.endlineno, parent=func)
