"""Every knob that changes which code runs, in one object read once from the environment.

Users set the environment variables below before importing flashtile; tests and the tile sweep change fields on
`SETTINGS` (or use `override`), and every launch reads the field when it runs, so a change takes effect on the next
call. Nothing else in the package reads `os.environ` for behaviour.

| field          | environment variable       | meaning                                                            |
|----------------|----------------------------|--------------------------------------------------------------------|
| gluon_forward  | FLASHTILE_GLUON=0          | off: the Hopper Gluon forward is not used (the portable kernel is) |
| gluon_backward | FLASHTILE_GLUON_BWD=0      | off: the Hopper Gluon backward is not used                         |
| lazy_max       | FLASHTILE_LAZY_MAX=0       | off: the Gluon forward takes every block's row maximum             |
| defer_check    | FLASHTILE_DEFER_CHECK=0    | off: bfloat16 Gluon forwards check their range every key block, as |
|                |                            | float16 ones do, not once per item with a redo pass (hopper_fwd)   |
| check_values   | FLASHTILE_CHECK_VALUES=1   | on: check CUDA index tensors' values too (a sync per call; CPU     |
|                |                            | ones always are); flashtile.check_values() sets it for a block     |
| compile_ahead  | FLASHTILE_COMPILE_AHEAD=0  | off: a differentiated forward that builds a new plan does not      |
|                |                            | compile its backward meanwhile in a helper thread (_ahead.py)      |
| tma            | (tests)                    | None: the hardware decides; True / False force TMA descriptors     |
| tiles          | (tests, tile sweep)        | None, a TileConfig list for every kernel, or {kind: list}          |
| decode_tiles   | (tests)                    | None or a TileConfig list for the decode kernel                    |
| page_slabs     | (tests)                    | False: paged decode reads one page per key row, never a slab       |
| fast_launch    | (tests, comparisons)       | False: every launch goes through Triton's JITFunction.run, and     |
|                |                            | every attention call chooses its backend and builds its launches   |
|                |                            | anew (no plans: flashtile/dispatch.py, "Plans")                    |
| eager_direct   | (tests, comparisons)       | False: eager calls go through the dispatcher like traced ones      |
| direct_launch  | (tests, comparisons)       | False: bound launches call Triton's CudaLauncher rather than its C |
|                |                            | launch function directly (kernels/_launch.py, _Direct)             |
"""
import contextlib
import dataclasses
import os
from typing import Optional, Union


def _flag(name, default):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value not in ("0", "false", "False", "off")


@dataclasses.dataclass
class Settings:
    gluon_forward: bool = True
    gluon_backward: bool = True
    lazy_max: bool = True
    defer_check: bool = True
    check_values: bool = False
    compile_ahead: bool = True
    tma: Optional[bool] = None
    tiles: Union[None, list, dict] = None
    decode_tiles: Optional[list] = None
    page_slabs: bool = True
    fast_launch: bool = True
    eager_direct: bool = True
    direct_launch: bool = True

    @classmethod
    def from_env(cls):
        return cls(gluon_forward=_flag("FLASHTILE_GLUON", True), gluon_backward=_flag("FLASHTILE_GLUON_BWD", True),
                   lazy_max=_flag("FLASHTILE_LAZY_MAX", True), defer_check=_flag("FLASHTILE_DEFER_CHECK", True),
                   check_values=_flag("FLASHTILE_CHECK_VALUES", False),
                   compile_ahead=_flag("FLASHTILE_COMPILE_AHEAD", True))


SETTINGS = Settings.from_env()


@contextlib.contextmanager
def override(**fields):
    """Set fields of SETTINGS for the duration of a with block (tests): `with override(tma=False): ...`."""
    unknown = set(fields) - {f.name for f in dataclasses.fields(Settings)}
    if unknown:
        raise TypeError(f"unknown setting(s) {sorted(unknown)}; the fields are "
                        f"{[f.name for f in dataclasses.fields(Settings)]}.")
    saved = {name: getattr(SETTINGS, name) for name in fields}
    for name, value in fields.items():
        setattr(SETTINGS, name, value)
    try:
        yield SETTINGS
    finally:
        for name, value in saved.items():
            setattr(SETTINGS, name, value)
