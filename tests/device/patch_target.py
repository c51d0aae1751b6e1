"""A tiny module the patch-manager tests patch (so they never touch real libraries)."""


def greet(name: str) -> str:
    return f"hello {name}"


class Box:
    def size(self) -> int:
        return 1
