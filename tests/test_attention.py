"""The decode-attention kernel in numba's CUDA simulator, against the float64 reference."""
from __future__ import annotations

import pytest
import torch

from trapetum import attention, gemv
from trapetum.attention import DecodeAttention, reference, rotate

pytestmark = pytest.mark.skipif(not gemv.SIM, reason="written for the CUDA simulator")


def inv_freq(D, base=10000.0):
    return 1.0 / base ** (torch.arange(0, D, 2).float() / D)


@pytest.mark.parametrize("H,Hkv,p,D", [(2, 2, 0, 16), (2, 2, 5, 16), (4, 2, 16, 16), (4, 1, 37, 16),
                                       (2, 1, 0, 32), (2, 1, 37, 64), (1, 1, 200, 32), (1, 1, 530, 64)])
def test_attention_matches_reference_and_writes_the_cache(H, Hkv, p, D):
    # D = 16: shared-memory reductions; D = 32 and 64: warp-shuffle reductions and 16-byte K loads
    # (D = 32 at p = 200: 26 splits, more than the merge keeps in flight at once; D = 64 at p = 530: 34
    # splits, more than warp 0 has lanes).
    T, L = max(48, p + 8), 2
    inv = inv_freq(D)
    pos = torch.tensor([p])
    att = DecodeAttention(L, H, Hkv, D, T, inv, pos, "cpu")
    g = torch.Generator().manual_seed(p)
    att.k_cache.copy_(torch.randn(att.k_cache.shape, generator=g).half())
    att.v_cache.copy_(torch.randn(att.v_cache.shape, generator=g).half())
    before_k, before_v = att.k_cache.clone(), att.v_cache.clone()
    qkv = torch.randn(1, (H + 2 * Hkv) * D, generator=g).half()
    out = torch.full((1, H * D), float("nan"), dtype=torch.float16)
    att.bind(1, qkv, out)()
    want = reference(qkv, before_k[1], before_v[1], inv, p, H, Hkv)
    err = float((out.double().view(-1) - want).abs().max() / want.abs().max())
    assert torch.isfinite(out).all() and err < 2e-3, err
    # the new token's rotated k and its v land at position p of layer 1, nothing else changes
    kv = qkv.view(-1)[H * D:].view(2, Hkv, D).double()
    k_new = rotate(kv[0], inv, p)
    assert torch.allclose(att.k_cache[1, :, p].double(), k_new, atol=2e-3)
    assert torch.equal(att.v_cache[1, :, p], kv[1].half())
    mask = torch.ones(T, dtype=torch.bool)
    mask[p] = False
    assert torch.equal(att.k_cache[1][:, mask], before_k[1][:, mask]) and torch.equal(att.k_cache[0], before_k[0])
    assert torch.equal(att.counters, torch.zeros_like(att.counters)), "the finish must reset its counters for the next replay"


def test_attention_reads_the_position_at_launch():
    D, T, H = 16, 40, 2
    inv = inv_freq(D)
    pos = torch.tensor([3])
    att = DecodeAttention(1, H, H, D, T, inv, pos, "cpu")
    qkv = torch.randn(1, 3 * H * D).half()
    out = torch.empty(1, H * D, dtype=torch.float16)
    launch = att.bind(0, qkv, out)
    launch()
    pos.fill_(20)
    k_before, v_before = att.k_cache[0].clone(), att.v_cache[0].clone()
    launch()
    want = reference(qkv, k_before, v_before, inv, 20, H, H)
    assert float((out.double().view(-1) - want).abs().max() / want.abs().max()) < 2e-3


def test_bad_shapes_are_refused():
    inv = inv_freq(16)
    pos = torch.tensor([0])
    with pytest.raises(ValueError, match="multiple"):
        DecodeAttention(1, 3, 2, 16, 8, inv, pos, "cpu")
    with pytest.raises(ValueError, match="inv_freq"):
        DecodeAttention(1, 2, 2, 16, 9, inv[:3], pos, "cpu")
    with pytest.raises(ValueError, match="context splits"):
        DecodeAttention(1, 2, 2, 16, 65, inv, pos, "cpu")
    with pytest.raises(ValueError, match="power of two"):
        attention.attention_kernel(24, 1)
    att = DecodeAttention(1, 2, 2, 16, 8, inv, pos, "cpu")
    with pytest.raises(ValueError, match="qkv"):
        att.bind(0, torch.zeros(1, 10, dtype=torch.float16), torch.zeros(1, 32, dtype=torch.float16))
