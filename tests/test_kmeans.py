"""Per-row weighted k-means: sorted codebooks, codes in range, determinism, importance, bad inputs."""
from __future__ import annotations

import pytest
import torch

from trapetum.kmeans import assign, check_finite, kmeans_rows


def weight(n_out=24, n_in=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_out, n_in, generator=g)


@pytest.mark.parametrize("K", [2, 16, 64, 256])
def test_codebooks_sorted_and_codes_in_range(K):
    W = weight(n_in=128)
    codes, cb, rep = kmeans_rows(W, K, device="cpu")
    assert codes.shape == W.shape and codes.dtype == torch.uint8
    assert cb.shape == (W.shape[0], K) and cb.dtype == torch.float32
    assert (cb[:, 1:] >= cb[:, :-1]).all(), "codebooks must be sorted per row"
    assert int(codes.max()) < K
    # every weight maps to its nearest centroid
    W_hat = cb.gather(1, codes.long())
    nearest = (W[:, :, None] - cb[:, None, :]).abs().min(dim=2).values
    assert torch.allclose((W - W_hat).abs(), nearest, atol=1e-6)
    assert rep.K == K and rep.rel_mse >= 0 and rep.max_abs_err == pytest.approx(float((W - W_hat).abs().max()), abs=1e-6)


def test_codebooks_are_centroids_of_their_clusters():
    W = weight(8, 256, seed=4)
    codes, cb, rep = kmeans_rows(W, 8, iters=100, device="cpu")
    assert rep.iters_run < 100, "Lloyd iterations should converge on 256 values"
    for r in range(W.shape[0]):
        for k in codes[r].unique().tolist():
            assert cb[r, k] == pytest.approx(float(W[r][codes[r] == k].mean()), abs=1e-5)


def test_deterministic():
    W = weight(seed=1)
    a = kmeans_rows(W, 16, seed=3, device="cpu")
    b = kmeans_rows(W, 16, seed=3, device="cpu")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_deterministic_when_empty_clusters_restart():
    # 64 levels for a row of 16 distinct values repeated: clusters go empty and restart on random members.
    W = torch.arange(16.0).repeat(4, 8)  # (4, 128)
    W = W + torch.linspace(0, 1e-3, 4)[:, None]
    a = kmeans_rows(W, 64, seed=5, device="cpu")
    b = kmeans_rows(W, 64, seed=5, device="cpu")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].max_abs_err == pytest.approx(0, abs=1e-6)  # 64 levels hold 16 values exactly


def test_row_chunking_does_not_change_the_result():
    W = weight(40, 64, seed=2)
    a = kmeans_rows(W, 16, device="cpu")
    b = kmeans_rows(W, 16, device="cpu", chunk_rows=7)
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1])


def _weighted_err(W, codes, cb, imp):
    return float((imp[None, :] * (W - cb.gather(1, codes.long())) ** 2).sum())


@pytest.mark.parametrize("imp_dim", [1, 2])
def test_importance_lowers_the_weighted_error(imp_dim):
    W = weight(16, 64, seed=6)
    imp = torch.ones(64)
    imp[11] = 1e4  # one heavily weighted input column
    codes_u, cb_u, _ = kmeans_rows(W, 4, device="cpu")
    given = imp if imp_dim == 1 else imp.expand_as(W).clone()
    codes_w, cb_w, rep = kmeans_rows(W, 4, device="cpu", importance=given)
    err_u, err_w = _weighted_err(W, codes_u, cb_u, imp), _weighted_err(W, codes_w, cb_w, imp)
    assert err_w < 0.5 * err_u
    # the heavy column is reproduced almost exactly
    col = (W[:, 11] - cb_w.gather(1, codes_w[:, 11:12].long())[:, 0]).abs().max()
    assert float(col) < 0.1 * float((W[:, 11] - cb_u.gather(1, codes_u[:, 11:12].long())[:, 0]).abs().max())
    # and the report is the importance-weighted error
    assert rep.rel_mse == pytest.approx(err_w / float((imp[None, :] * W**2).sum()), rel=1e-3)


def test_all_zero_importance_columns_still_get_codes():
    W = weight(8, 32, seed=7)
    imp = torch.zeros(32)
    imp[:4] = 1.0
    codes, cb, _ = kmeans_rows(W, 4, device="cpu", importance=imp)
    assert torch.isfinite(cb).all() and int(codes.max()) < 4


def test_assign_picks_the_nearest_sorted_centroid():
    cb = torch.tensor([[-1.0, 0.0, 2.0]])
    W = torch.tensor([[-5.0, -0.6, -0.4, 0.9, 1.1, 7.0]])
    assert assign(W, cb).tolist() == [[0, 0, 1, 1, 2, 2]]


# -- bad inputs -------------------------------------------------------------------------------
def test_1d_weight_is_refused():
    with pytest.raises(ValueError, match=r"W must be 2-D.*\(64,\)"):
        kmeans_rows(torch.randn(64), 16)


@pytest.mark.parametrize("K", [0, 1, 257, 1024])
def test_K_out_of_range(K):
    with pytest.raises(ValueError, match=rf"K must be in \[2, 256\], got {K}"):
        kmeans_rows(weight(), K)


@pytest.mark.parametrize(
    "imp, match",
    [
        (torch.ones(95), "importance has 95 entries, W has 96"),
        (torch.ones(24, 95), r"importance shape \(24, 95\) matches neither"),
        (torch.ones(1, 96, 1), r"importance shape \(1, 96, 1\)"),
    ],
)
def test_importance_of_the_wrong_shape(imp, match):
    with pytest.raises(ValueError, match=match):
        kmeans_rows(weight(), 16, importance=imp, device="cpu")


def test_negative_importance():
    imp = torch.ones(96)
    imp[3] = -0.5
    with pytest.raises(ValueError, match="importance must be non-negative"):
        kmeans_rows(weight(), 16, importance=imp, device="cpu")


def test_non_finite_importance():
    imp = torch.ones(96)
    imp[3] = float("nan")
    with pytest.raises(ValueError, match=r"importance has 1 NaN/Inf"):
        kmeans_rows(weight(), 16, importance=imp, device="cpu")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight(bad):
    W = weight()
    W[2, 40] = bad
    W[7, 1] = bad
    with pytest.raises(ValueError, match=r"weight has 2 NaN/Inf value\(s\), the first at \[2, 40\]"):
        kmeans_rows(W, 16, device="cpu")


def test_integer_weight_is_refused():
    with pytest.raises(TypeError, match="floating-point"):
        check_finite(torch.ones(4, 4, dtype=torch.int32))
