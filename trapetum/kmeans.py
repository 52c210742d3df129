"""Per-output-channel scalar k-means: every row of a weight matrix gets its own K-entry codebook.

1-D k-means has sorted centroids, so the nearest centroid of a value is found by a binary
search over the K-1 midpoints (``torch.searchsorted``): memory stays O(out x in), not
O(out x in x K), and it runs on the GPU when there is one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KMeansReport:
    """What quantizing one matrix cost and how close it came."""

    K: int
    iters_run: int
    rel_mse: float  # ||W - W_hat||^2 / ||W||^2 (importance-weighted when importance is given)
    max_abs_err: float


def check_finite(W: torch.Tensor, what: str = "weight") -> None:
    if not torch.is_floating_point(W):
        raise TypeError(f"{what} must be a floating-point tensor, got {W.dtype}")
    bad = ~torch.isfinite(W)
    if bad.any():
        n = int(bad.sum())
        r, c = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{what} has {n} NaN/Inf value(s), the first at [{r}, {c}]; refusing to quantize")


def _weighted_quantiles(W: torch.Tensor, imp: torch.Tensor, K: int) -> torch.Tensor:
    # Start from the (importance-weighted) quantiles: deterministic and already close to the optimum for 1-D data.
    vals, order = W.sort(dim=1)
    w = imp.expand_as(W).gather(1, order)
    cdf = w.cumsum(1)
    cdf = cdf / cdf[:, -1:].clamp_min(1e-30)
    targets = (torch.arange(K, device=W.device, dtype=W.dtype) + 0.5) / K
    idx = torch.searchsorted(cdf.contiguous(), targets.expand(W.shape[0], K).contiguous())
    return vals.gather(1, idx.clamp_max(W.shape[1] - 1))


def assign(W: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid for every weight; centroids must be sorted per row."""
    mid = (centroids[:, 1:] + centroids[:, :-1]) * 0.5
    return torch.searchsorted(mid.contiguous(), W.contiguous())


def kmeans_rows(
    W: torch.Tensor,
    K: int,
    iters: int = 25,
    seed: int = 0,
    importance: torch.Tensor | None = None,
    device: str | torch.device | None = None,
    chunk_rows: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor, KMeansReport]:
    """Quantize each row of ``W`` (out x in) to K levels with weighted Lloyd iterations.

    importance: None, a per-input-column vector (in,) (activation-aware: mean x_i^2 over
    calibration data) or a full (out, in) tensor; the objective is sum imp * (w - c)^2.

    Returns (codes uint8 [out, in] on W's device, codebook float32 [out, K] sorted per row, report).
    Deterministic for a given seed: the seed only decides where empty clusters restart.
    """
    if W.dim() != 2:
        raise ValueError(f"W must be 2-D (out_features, in_features), got shape {tuple(W.shape)}")
    if not 2 <= K <= 256:
        raise ValueError(f"K must be in [2, 256], got {K}")
    check_finite(W)
    out_dev = W.device
    dev = torch.device(device) if device is not None else (torch.device("cuda") if torch.cuda.is_available() else W.device)
    Wf = W.detach().to(dev, torch.float32)
    if importance is None:
        imp = torch.ones(1, Wf.shape[1], device=dev)
    else:
        imp = importance.detach().to(dev, torch.float32)
        if imp.dim() == 1:
            if imp.shape[0] != Wf.shape[1]:
                raise ValueError(f"importance has {imp.shape[0]} entries, W has {Wf.shape[1]} input columns")
            imp = imp[None, :]
        elif imp.shape != Wf.shape:
            raise ValueError(f"importance shape {tuple(imp.shape)} matches neither (in,) nor W {tuple(Wf.shape)}")
        check_finite(imp, "importance")
        if (imp < 0).any():
            raise ValueError("importance must be non-negative")
        imp = imp + 1e-12 * imp.mean().clamp_min(1e-30)  # all-zero columns still need a cluster
    gen = torch.Generator(device="cpu").manual_seed(seed)

    codes_out = torch.empty(Wf.shape, dtype=torch.uint8, device=dev)
    cb_out = torch.empty(Wf.shape[0], K, dtype=torch.float32, device=dev)
    iters_run = 0
    for r0 in range(0, Wf.shape[0], chunk_rows):
        w = Wf[r0 : r0 + chunk_rows]
        im = imp if imp.shape[0] == 1 else imp[r0 : r0 + chunk_rows]
        c = _weighted_quantiles(w, im, K)
        codes = assign(w, c)
        for it in range(iters):
            ww = im.expand_as(w)
            sums = torch.zeros_like(c).scatter_add_(1, codes, w * ww)
            cnt = torch.zeros_like(c).scatter_add_(1, codes, ww)
            empty = cnt <= 0
            new_c = torch.where(empty, c, sums / cnt.clamp_min(1e-30))
            if empty.any():
                # Restart an empty cluster on a random member of its row (seeded, so runs repeat).
                rows, ks = empty.nonzero(as_tuple=True)
                pick = torch.randint(0, w.shape[1], (rows.numel(),), generator=gen).to(dev)
                new_c[rows, ks] = w[rows, pick]
            new_c, _ = new_c.sort(dim=1)
            new_codes = assign(w, new_c)
            iters_run = max(iters_run, it + 1)
            changed = not torch.equal(new_codes, codes)
            c, codes = new_c, new_codes
            if not changed:
                break
        codes_out[r0 : r0 + chunk_rows] = codes.to(torch.uint8)
        cb_out[r0 : r0 + chunk_rows] = c

    W_hat = cb_out.gather(1, codes_out.long())
    err = (Wf - W_hat) ** 2
    denom = (Wf**2 * imp.expand_as(Wf)).sum().clamp_min(1e-30)
    report = KMeansReport(
        K=K,
        iters_run=iters_run,
        rel_mse=float((err * imp.expand_as(Wf)).sum() / denom),
        max_abs_err=float((Wf - W_hat).abs().max()),
    )
    return codes_out.to(out_dev), cb_out.to(out_dev), report
