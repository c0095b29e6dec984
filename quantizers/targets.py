"""Which Linear layers a quantizer touches: name patterns, matched explicitly."""

from __future__ import annotations

from torch import nn

from compress.schema.patterns import matches

__all__ = ["select_linears"]


def select_linears(
    model: nn.Module, targets: list[str], ignore: list[str], extra: list[tuple[str, nn.Linear]] | tuple = ()
) -> tuple[list[tuple[str, nn.Linear]], list[str]]:
    """Linear modules matched by ``targets`` and by no ``ignore`` pattern, in model order, then the
    candidates ``extra`` (named layers that are no module of ``model``, e.g. fused experts' matrices).

    Also returns the ignore patterns that matched no Linear layer (reported, not an error:
    the default ``lm_head`` may not exist in every model).
    """
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)] + list(extra)
    chosen = [(n, m) for n, m in linears if any(matches(n, p) for p in targets) and not any(matches(n, p) for p in ignore)]
    unused_ignore = [p for p in ignore if not any(matches(n, p) for n, _ in linears)]
    return chosen, unused_ignore
