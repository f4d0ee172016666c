"""Repeated blocks by module path: 'layers.3.attn.wq' lies in block 'layers.3' (an instance of an indexed
container, such as a decoder's layers)."""

from __future__ import annotations

import functools
import re

_INSTANCE = re.compile(r"^(.*?\.\d+)(?:\.|$)")


@functools.lru_cache(maxsize=1 << 16)  # a pure function of the path, asked per node per scenario priced
def block_of(module: str) -> str | None:
    """The repeated block a module path lies in: 'layers.3.attn.wq' -> 'layers.3'; None
    outside any indexed container."""
    match = _INSTANCE.match(module)
    return match.group(1) if match else None


def repeated_blocks(modules: list[str]) -> list[str]:
    """Every block instance the module paths reach, in first-seen order."""
    return list(dict.fromkeys(b for b in map(block_of, modules) if b is not None))


def in_block(module: str, block: str) -> bool:
    return module == block or module.startswith(block + ".")
