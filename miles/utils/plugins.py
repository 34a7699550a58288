"""Loading user extensions by dotted path: rewards, filters, backend and server subclasses.

Every plug-in flag (`--custom-rm-path`, `--dynamic-sampling-filter-path`,
`--multi-lora-backend-path`, `--multi-lora-http-server-path`, an adapter's
`custom_rm_path`) goes through these functions, so each gives the same clear error, at
load time rather than at first use:

    fn = load_callable("my_pkg.rewards.length", kind="custom_rm_path", params="args, sample")
    cls = load_subclass("my_pkg.servers.Quota", MultiLoRABackend, "--multi-lora-backend-path")

`pkg.module.attr` and `pkg.module:attr` are both accepted. A path that arrives over the
network is first checked against the allowed module prefixes (`path_in_modules`), before
anything is imported.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, TypeVar

T = TypeVar("T")


class PluginError(ValueError):
    """A dotted path that cannot be used; the message names the flag and what to fix."""


def load_object(path: str, *, kind: str) -> Any:
    """The object at `pkg.module.attr` (or `pkg.module:attr`); `kind` names the flag in errors."""
    if not isinstance(path, str):
        raise PluginError(f"{kind} must be a dotted path string, got {type(path).__name__}")
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise PluginError(f"{kind} {path!r}: expected a dotted path such as my_pkg.my_module.name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{kind} {path!r} cannot be imported: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"{kind} {path!r} cannot be imported: module {module_name!r} has no {attr!r}") from None


def check_signature(fn: Any, path: str, *, kind: str, params: str) -> None:
    """PluginError unless `fn` is callable with as many positional arguments as `params` names."""
    if not callable(fn):
        raise PluginError(f"{kind} {path!r} is not callable (got {type(fn).__name__})")
    n_args = len([p for p in params.split(",") if p.strip()])
    try:
        inspect.signature(fn).bind(*([None] * n_args))
    except TypeError:
        raise PluginError(f"{kind} {path!r} has the wrong signature: expected fn({params})") from None
    except ValueError:
        return  # builtins without an introspectable signature: trust them


def load_callable(path: str, *, kind: str, params: str) -> Any:
    """`load_object` + `check_signature`: a function taking the documented arguments.

    >>> load_callable("os.path.join", kind="--example", params="a, b").__name__
    'join'
    """
    fn = load_object(path, kind=kind)
    check_signature(fn, path, kind=kind, params=params)
    return fn


def load_subclass(path: str | None, base: type[T], flag: str) -> type[T]:
    """`base` itself when `path` is None, else the class at dotted `path`, which must subclass it."""
    if path is None:
        return base
    cls = load_object(path, kind=flag)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PluginError(f"{flag} {path!r}: must be a subclass of {base.__module__}.{base.__qualname__}")
    return cls


def plugin_module(path: str) -> str:
    """The module a dotted path names its object in: `pkg.mod` of `pkg.mod.fn` or `pkg.mod:fn`."""
    return path.partition(":")[0] if ":" in path else path.rpartition(".")[0]


def path_in_modules(path: str, modules: tuple[str, ...]) -> bool:
    """Whether `path` names an object inside one of `modules` (a module and its submodules:
    `miles` covers `miles.rollout.rm_hub.f1`, never `milesx.f`).

    >>> path_in_modules("miles.rollout.rewards.f1", ("miles",)), path_in_modules("os.system", ("miles",))
    (True, False)
    """
    module = plugin_module(path)
    return any(module == m or module.startswith(m + ".") for m in (m.rstrip(".") for m in modules) if m)
