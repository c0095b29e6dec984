"""Our benchmark rows paired with a runtime's own rows of the same size (`compress bench gguf` against
llama.cpp's types, `compress bench onnx` against the model builder's): size, KL and decode-speed ratios,
and their Markdown table."""

from __future__ import annotations

from typing import Any

SIZE_TOLERANCE = 0.02  # a benchmark pair whose file sizes differ by more is not an equal-bytes comparison


def equal_bytes_pairs(rows: list[dict[str, Any]], ours_key: Any, theirs_key: Any, theirs: str) -> list[dict[str, Any]]:
    """Each of our benchmark rows against the runtime's own row it matches (``ours_key(row)`` equal to
    ``theirs_key(row)``; None: not part of a pair): size, KL and decode-speed ratios, and whether the
    sizes are within SIZE_TOLERANCE. ``theirs``: the key naming their row in each pair."""
    found: dict[Any, dict[str, Any]] = {}
    for r in rows:
        key = theirs_key(r)
        if key is not None:
            found.setdefault(key, r)
    out = []
    for r in rows:
        key = ours_key(r)
        other = found.get(key) if key is not None else None
        if other is None or other is r:
            continue
        size = r["size_bytes"] / other["size_bytes"]
        kl_theirs = other["metrics"]["kl_divergence"]
        out.append(
            {
                "ours": r["name"],
                theirs: other["name"],
                "size_ratio": round(size, 4),
                "equal_bytes": abs(size - 1) <= SIZE_TOLERANCE,
                "kl_ratio": round(r["metrics"]["kl_divergence"] / kl_theirs, 4) if kl_theirs > 0 else None,
                "decode_ratio": round(r["decode_tokens_per_s"] / other["decode_tokens_per_s"], 4),
            }
        )
    return out


def pairs_table(pairs: list[dict[str, Any]], theirs: str, title: str) -> list[str]:
    """Markdown lines of :func:`equal_bytes_pairs`, a pair outside SIZE_TOLERANCE flagged."""
    if not pairs:
        return []
    lines = ["", f"| ours | {title} | size ratio | KL ratio | decode ratio |", "|---|---|---|---|---|"]
    for p in pairs:
        flag = "" if p["equal_bytes"] else f" (sizes differ by more than {SIZE_TOLERANCE:.0%})"
        kl = "—" if p["kl_ratio"] is None else f"{p['kl_ratio']:.3f}"
        lines.append(f"| {p['ours']} | {p[theirs]} | {p['size_ratio']:.4f}{flag} | {kl} | {p['decode_ratio']:.3f} |")
    return lines
