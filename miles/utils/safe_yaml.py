"""The one YAML loader of the project: safe, without aliases, and with 1.2-style numbers.

Adapter configs, `--config` files and YAML request bodies are read with `load_yaml`:
- it builds plain Python values only (`yaml.SafeLoader`), never objects;
- anchors and aliases (`&x` / `*x`) are refused, so a "billion laughs" document cannot
  expand a few hundred bytes into gigabytes;
- `1e-3`, `5E4` are floats, as YAML 1.2 and JSON read them (YAML 1.1 needs a dot,
  so plain PyYAML returns the string `'1e-3'`).

    load_yaml("lr: 1e-3")              # {'lr': 0.001}
    load_yaml("a: &x [1]\\nb: *x")      # YAMLAliasError
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class YAMLAliasError(yaml.YAMLError):
    """The document uses an anchor or an alias, which are not accepted."""


_EXPONENT_FLOAT = re.compile(
    r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"
)


class NoAliasSafeLoader(yaml.SafeLoader):
    """`SafeLoader` that refuses anchors and aliases and reads exponent floats."""

    yaml_implicit_resolvers = {key: list(value) for key, value in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise YAMLAliasError(
                f"anchors and aliases (&name / *name) are not accepted (line {event.start_mark.line + 1}); "
                "write the values out"
            )
        return super().compose_node(parent, index)


NoAliasSafeLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))


def load_yaml(text: str | bytes) -> Any:
    """Parse one YAML document safely; `yaml.YAMLError` (or `YAMLAliasError`) if it is bad."""
    return yaml.load(text, Loader=NoAliasSafeLoader)  # noqa: S506 - a SafeLoader subclass
