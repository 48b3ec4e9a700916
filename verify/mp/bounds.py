"""Derived bounds between a tensor-parallel operator (N_m ranks) and the same operator at N_m = 1.

Notation as verify/checks/bounds.py: u the unit roundoff, γ_k = k·u/(1 - k·u); N = N_m; magnitudes
are
float64 (their own error, ~1e-16 relative, is nothing next to γ). The derivations, and why only
operators (not whole models) are compared, are in docs/design.md §6.

Split dot products (row-parallel forward, f's backward). y = Σ_{i<k} a_i·b_i (+ c). Any order of
n rounded products and sums has |ŷ - y| <= γ_n·Σ|a_i·b_i| (Higham eq. 3.5); a bias is one more
term. At N_m = 1 one dot product of k terms: γ_{k+1}. At N_m = N each rank sums k/N products,
the N partials are added (the tree's ⌈log2 N⌉ or a ring's N - 1 additions: N - 1 covers both),
then the bias: every term passes through at most k/N + N roundings, γ_{k/N+N}. The two results
therefore differ by at most (γ_{k+c} + γ_{k/N+N-1+c})·(|a|·|b| + |c|), c = 1 with a bias.

Cross entropy: see ``xent_bounds``.
"""

from __future__ import annotations

import torch

from ..checks.bounds import UNIT_ROUNDOFF, gamma

U32 = UNIT_ROUNDOFF["fp32"]


def split_dot_bound(a, b, *, n: int, bias=None, u: float = U32) -> torch.Tensor:
    """Elementwise bound on |y_N - y_1| for y = a·bᵀ (+ bias), a (.., k), b (out, k), the
    inner dimension k split over n ranks (k divisible by n). Returns float64 (.., out)."""
    k = a.shape[-1]
    c = 0 if bias is None else 1
    mag = a.double().abs() @ b.double().abs().T
    if bias is not None:
        mag = mag + bias.double().abs()
    return (gamma(k + c, u) + gamma(k // n + n - 1 + c, u)) * mag


def any_order_bound(a, b, *, bias=None, u: float = U32) -> torch.Tensor:
    """Elementwise bound on the difference of two evaluations of a·bᵀ (+ bias) that may order
    the same k products differently (a kernel picked by the matrix's width): 2·γ_{k+c}·(|a|·|b|ᵀ
    + |bias|), c = 1 with a bias. Returns float64."""
    c = 0 if bias is None else 1
    mag = a.double().abs() @ b.double().abs().T
    if bias is not None:
        mag = mag + bias.double().abs()
    return 2 * gamma(a.shape[-1] + c, u) * mag


def xent_bounds(logits: torch.Tensor, targets: torch.Tensor, *, n: int, u: float = U32):
    """(loss bound, gradient bound) between the vocabulary-parallel cross entropy over n ranks
    and F.cross_entropy (mean over T tokens) on the same float32 logits (T, V).

    Per token, with m = max_v z_v (exact on both sides), w_v = z_v - m, S = Σ_v exp(w_v) and
    ℓ = log S - w_t, first order in u, assuming exp and log within 1 ulp (2u relative):
      each exp(ŵ_v) is exp(w_v)·(1 + ε_v), |ε_v| <= u·|w_v| + 2u (the subtraction, then exp);
      Ŝ = S·(1 + θ), |θ| <= θ_n := γ_{s-1} + 2u + u·max|w_v|, s = V terms at N_m = 1 and
      V/N + N - 1 roundings per term at N_m = N (local sum, then the partials);
      log Ŝ = log S + θ' with |θ'| <= |θ|·(1 + |θ|) plus log's 2u·|log S|; then at most four
      more roundings of values below |m| + |log S| + |z_t| + |ℓ| (whichever way a library
      writes ℓ: log S - w_t or (m + log S) - z_t), charged as 4u per side.
      The mean adds γ_{T-1}·Σ|ℓ|/T and one rounding u·|L| on each side.
    Gradient ∂L/∂z_v = (p_v - [v = t])/T with p_v = exp(w_v)/S: each side computes p_v with
    relative error <= κ_v := θ_n + 4u·(1 + |w_v| + |log S|) (exp, the sum, a division or
    exp(log-softmax), one more exp), then a subtraction and the 1/T scaling: 2u·|p_v - [v=t]|.
    """
    z = logits.detach().double()
    t_count, v = z.shape
    m = z.max(dim=-1, keepdim=True).values
    w = z - m
    s = torch.exp(w).sum(-1, keepdim=True)
    log_s = torch.log(s)
    p = torch.exp(w) / s
    onehot = torch.zeros_like(z).scatter_(-1, targets.view(-1, 1), 1.0)
    z_t = z.gather(-1, targets.view(-1, 1))
    ell = log_s - w.gather(-1, targets.view(-1, 1))
    wmax = w.abs().max(dim=-1, keepdim=True).values

    def theta(terms: int) -> torch.Tensor:
        return gamma(terms - 1, u) + 2 * u + u * wmax

    th1, thn = theta(v), theta(v // n + n)
    mags = m.abs() + log_s.abs() + z_t.abs() + ell.abs()
    tok = sum(th * (1 + th) + 2 * u * log_s.abs() + 4 * u * mags for th in (th1, thn))
    mean = ell.mean().abs().item()
    loss_bound = (
        tok.mean().item()
        + 2 * gamma(max(t_count - 1, 0), u) * ell.abs().mean().item()
        + 2 * u * mean
    )
    kappa = sum(th + 4 * u * (1 + w.abs() + log_s.abs()) for th in (th1, thn))
    grad_bound = (kappa * p + 4 * u * (p - onehot).abs()) / t_count
    return loss_bound, grad_bound


def ratio(diff: torch.Tensor, bound: torch.Tensor) -> float:
    """max(|diff| / bound) over elements (0/0 counts as 0; x/0 as inf)."""
    d = diff.detach().double().abs()
    b = torch.as_tensor(bound, dtype=torch.float64)
    r = torch.where(d == 0, torch.zeros_like(d), d / b)
    return float(r.max()) if r.numel() else 0.0


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The int32 view of a float32 tensor, for bitwise comparison."""
    return t.detach().contiguous().view(torch.int32)
