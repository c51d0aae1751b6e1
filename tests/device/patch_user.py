"""Takes a copy with ``from x import f`` before any patch is applied (rebinding test)."""

from patch_target import greet


def call() -> str:
    return greet("user")
