"""`tinker_cookbook.supervised.train` run from the command line, as its own `__main__` means to.

The module's `__main__` (tinker-cookbook 0.5.8) hands `chz.nested_entrypoint` a lambda with no
annotated argument and fails with "Nested entrypoints must take a type annotated argument".
This runs the same `main(Config)` with the same `key=value` arguments; it imports only the
cookbook, so it runs under the cookbook's own interpreter:

    python cookbook_sl_entry.py log_path=... model_name=... recipe_name=... \
        dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder ...
"""

import asyncio

import chz
from tinker_cookbook.supervised import train


def run(config: train.Config) -> None:
    asyncio.run(train.main(config))


if __name__ == "__main__":
    chz.nested_entrypoint(run, allow_hyphens=True)
