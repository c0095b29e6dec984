"""The orthogonal matrices the ``rotate:`` stage turns the model by (pure math, float64).

- ``random_orthogonal``: Haar-random, from the QR decomposition of a seeded Gaussian matrix with the
  signs fixed (each column times the sign of R's diagonal entry), so the distribution is uniform.
- ``randomized_hadamard``: H / sqrt(n) times a random ±1 diagonal (QuaRot). H is a Hadamard matrix of
  order n (entries ±1, H Hᵀ = n I), built as the Kronecker product of a Paley matrix of order m = n's odd
  part times a power of two (Paley I: m − 1 a prime ≡ 3 mod 4; Paley II: m / 2 − 1 a prime ≡ 1 mod 4)
  with Sylvester's matrix of order n / m. SmolLM2's 576 = 36 · 16 (Paley II, q = 17), Qwen2.5-1.5B's
  1536 = 12 · 128 (Paley I, q = 11), 896 = 28 · 32 (Paley II, q = 13). ``hadamard`` returns None for an
  order it cannot build (the stage then uses a random orthogonal matrix and says so: stage.py).
"""

from __future__ import annotations

import math

import torch

__all__ = ["hadamard", "random_orthogonal", "randomized_hadamard"]


def random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """A Haar-random orthogonal matrix [n, n] (float64)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    signs = torch.sign(torch.diagonal(r))
    return q * torch.where(signs == 0, torch.ones_like(signs), signs)


def hadamard(n: int) -> tuple[torch.Tensor, str] | None:
    """A Hadamard matrix of order ``n`` (float64, entries ±1) and how it was built, or None."""
    power = n & -n  # the largest power of two dividing n
    odd = n // power
    for shift in range(power.bit_length()):
        m = odd << shift
        base = _paley(m) if m > 1 else (torch.ones(1, 1, dtype=torch.float64), "")
        if base is not None:
            matrix, how = base
            rest = n // m
            return torch.kron(matrix, _sylvester(rest)), (f"{how} ⊗ Sylvester {rest}" if how else f"Sylvester {rest}")
    return None


def randomized_hadamard(n: int, generator: torch.Generator) -> tuple[torch.Tensor, str] | None:
    """diag(±1) · H / sqrt(n), orthogonal (float64), and how H was built; None when ``hadamard(n)`` is."""
    found = hadamard(n)
    if found is None:
        return None
    h, how = found
    signs = torch.randint(0, 2, (n,), generator=generator).to(torch.float64) * 2 - 1
    return signs[:, None] * h / math.sqrt(n), how


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = χ(j − i) over the integers mod the prime q (χ: the quadratic character, χ(0) = 0)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)], dtype=torch.float64)
    index = torch.arange(q)
    return chi[(index[None, :] - index[:, None]) % q]


def _paley(m: int) -> tuple[torch.Tensor, str] | None:
    """A Hadamard matrix of order ``m`` from Paley's constructions over a prime field, or None."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: I + [[0, 1ᵀ], [−1, Q]], Q antisymmetric
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return torch.eye(m, dtype=torch.float64) + s, f"Paley I {m}"
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II: the symmetric conference matrix C, doubled
        c = torch.zeros(m // 2, m // 2, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, one) + torch.kron(torch.eye(m // 2, dtype=torch.float64), zero), f"Paley II {m}"
    return None
