"""Layer patterns of the model type: which layers are MoE (``--moe-layer-freq``), use a sliding
window or a linear-attention mixer, as a 0/1 list per layer; read and written in Megatron's
notation (``N`` or ``[0]*1+[1]*3``), without ``eval``."""

from __future__ import annotations


def layer_pattern(freq: str | int, num_layers: int, flag: str = "--moe-layer-freq") -> list[int]:
    """Megatron's ``--moe-layer-freq``: ``N`` (layer i is MoE when i % N == 0, Python's modulo
    as Megatron computes it: MindSpeed-LLM's ``-1`` makes every layer MoE) or a list
    expression such as ``([0]*1+[1]*3)``, read without ``eval``; 1 marks a MoE layer."""
    text = str(freq).replace(" ", "")
    if text.lstrip("-").isdigit():
        n = int(text)
        if n == 0:
            raise ValueError(f"{flag} must not be 0 (every N-th layer is MoE)")
        return [1 if i % n == 0 else 0 for i in range(num_layers)]
    body = text[1:-1] if text.startswith("(") and text.endswith(")") else text
    pattern: list[int] = []
    for term in body.split("+"):
        values, _, times = term.partition("*")
        if not (values.startswith("[") and values.endswith("]")) or (times and not times.isdigit()):
            raise ValueError(f"{flag}: cannot read {freq!r} (e.g. 2 or '[0]*1+[1]*3')")
        items = [v for v in values[1:-1].split(",") if v]
        if any(v not in ("0", "1") for v in items):
            raise ValueError(f"{flag}: entries must be 0 or 1 (got {freq!r})")
        pattern += [int(v) for v in items] * int(times or 1)
    if len(pattern) != num_layers:
        raise ValueError(
            f"{flag} {freq!r} describes {len(pattern)} layers; --num-layers is {num_layers}"
        )
    return pattern


def pattern_text(bits: list[int]) -> str:
    """Megatron's ``--moe-layer-freq`` for a 0/1 layer list: ``1`` when every layer is MoE, else
    run-length terms such as ``[0]*1+[1]*26`` (which :func:`layer_pattern` reads back)."""
    if all(bits):
        return "1"
    runs: list[list[int]] = []
    for b in bits:
        if runs and runs[-1][0] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return "+".join(f"[{b}]*{n}" for b, n in runs)
