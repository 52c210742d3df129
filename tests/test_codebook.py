"""The codebook format: packing, validation, quantize(), the kernel tiling and the checked file format."""
from __future__ import annotations

import json
import math

import pytest
import torch

from trapetum import codebook as C
from trapetum.codebook import CodebookFormatError, CodebookTensor

KS = (16, 64, 256)


def rand_codes(n_out, n_in, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, K, (n_out, n_in), generator=g, dtype=torch.int64)


def weight(n_out=48, n_in=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_out, n_in, generator=g) * 0.02


# -- packing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("K", KS)
def test_pack_unpack_round_trip(K):
    q = rand_codes(40, 96, K)
    packed = C.pack_codes(q, K)
    assert packed.dtype == torch.uint8 and packed.is_contiguous()
    assert packed.shape == (40, 96 // C.codes_per_byte(K))
    assert torch.equal(C.unpack_codes(packed, K).long(), q)


def test_4bit_packing_puts_the_even_column_in_the_low_nibble():
    q = torch.tensor([[1, 2] + [0] * 30], dtype=torch.int32)
    packed = C.pack_codes(q, 16)
    assert int(packed[0, 0]) == 0x21


@pytest.mark.parametrize("K, n_in", [(16, 48), (16, 16), (64, 40), (256, 8), (16, 0)])
def test_in_features_must_fill_16_byte_chunks(K, n_in):
    cols = 32 if K == 16 else 16
    with pytest.raises(ValueError, match=rf"in_features={n_in} is not divisible by {cols}"):
        C.pack_codes(torch.zeros(4, n_in, dtype=torch.int32), K)
    with pytest.raises(ValueError, match=rf"in_features={n_in}"):
        C.quantize(torch.randn(4, n_in) if n_in else torch.randn(4, 0), K=K)


@pytest.mark.parametrize("K", [0, 8, 32, 128, 257])
def test_unsupported_K_is_refused(K):
    with pytest.raises(ValueError, match=rf"K must be one of .*got {K}"):
        C.packing_for(K)
    with pytest.raises(ValueError, match=r"K must be one of"):
        C.quantize(weight(), K=K)
    with pytest.raises(ValueError, match=r"K must be one of"):
        C.random_codebook_tensor(32, 64, K)


@pytest.mark.parametrize("K", KS)
def test_pack_codes_rejects_codes_out_of_range(K):
    q = rand_codes(8, 64, K)
    q[3, 5] = K
    with pytest.raises(ValueError, match=rf"codes out of range.*K={K}"):
        C.pack_codes(q, K)
    q[3, 5] = -1
    with pytest.raises(ValueError, match=r"codes out of range"):
        C.pack_codes(q, K)


def test_pack_codes_rejects_float_codes():
    with pytest.raises(TypeError, match="integer"):
        C.pack_codes(torch.zeros(4, 32), 16)


def test_codebook_tensor_rejects_uint8_codes_beyond_K():
    ct = C.random_codebook_tensor(8, 64, 64)
    codes = ct.codes.clone()
    codes[2, 7] = 64
    with pytest.raises(CodebookFormatError, match=r"max code 64 >= K=64"):
        CodebookTensor(codes, ct.codebook, 64, 64, 8)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda ct: {"codes": ct.codes.to(torch.int32)}, "codes must be uint8"),
        (lambda ct: {"codebook": ct.codebook.float()}, "codebook must be float16"),
        (lambda ct: {"codes": ct.codes[:-1]}, "codes shape"),
        (lambda ct: {"codebook": ct.codebook[:, :-1]}, "codebook shape"),
        (lambda ct: {"codebook": ct.codebook.clone().index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan"), dtype=torch.float16))}, "NaN/Inf"),
    ],
)
def test_codebook_tensor_validates_its_parts(change, match):
    ct = C.random_codebook_tensor(8, 64, 16)
    parts = {"codes": ct.codes, "codebook": ct.codebook, **change(ct)}
    with pytest.raises(CodebookFormatError, match=match):
        CodebookTensor(parts["codes"], parts["codebook"], 16, 64, 8)


# -- quantize ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_quantize_refuses_non_finite_weights(bad):
    W = weight()
    W[5, 9] = bad
    with pytest.raises(ValueError, match=r"NaN.*\[5, 9\]"):
        C.quantize(W, K=16)


def test_quantize_is_deterministic_for_a_seed():
    W = weight(64, 128, seed=3)
    a, ra = C.quantize(W, K=16, seed=7)
    b, rb = C.quantize(W, K=16, seed=7)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.codebook, b.codebook)
    assert ra == rb


@pytest.mark.parametrize("K", KS)
def test_quantize_reconstructs_the_weight(K):
    W = weight(32, 256, seed=1)
    ct, rep = C.quantize(W, K=K)
    assert (ct.K, ct.in_features, ct.out_features) == (K, 256, 32)
    W_hat = ct.dequantize(torch.float32)
    rel = float(((W - W_hat) ** 2).sum() / (W**2).sum())
    # The report describes the float32 codebook; the stored one is fp16, so allow its rounding
    # (half an fp16 ulp of the largest weight; K=256 on 256 columns is lossless before it).
    fp16_round = float(W.abs().max()) * 2**-11
    assert rep.rel_mse == pytest.approx(rel, rel=0.05, abs=fp16_round**2 * W.numel() / float((W**2).sum()))
    assert rep.max_abs_err == pytest.approx(float((W - W_hat).abs().max()), rel=0.05, abs=fp16_round)
    assert 0 < rep.iters_run <= 25


def test_reconstruction_error_shrinks_as_K_grows():
    W = weight(32, 256, seed=2)
    errs = [C.quantize(W, K=K)[1].rel_mse for K in KS]
    assert errs[0] > errs[1] > errs[2]
    assert errs[0] < 0.02  # 16 levels of a Gaussian: about 0.0095 at the optimum


@pytest.mark.parametrize("K, n_in, bits", [(16, 64, 4 + 16 * 16 / 64), (16, 4096, 4 + 256 / 4096), (64, 4096, 8 + 1024 / 4096), (256, 4096, 9.0)])
def test_bits_per_weight(K, n_in, bits):
    ct = C.random_codebook_tensor(32, n_in, K)
    assert ct.bits_per_weight == pytest.approx(bits)
    # nbytes counts exactly what bits_per_weight describes
    assert ct.nbytes * 8 == pytest.approx(ct.bits_per_weight * 32 * n_in)


# -- tiling -----------------------------------------------------------------------------------
@pytest.mark.parametrize("K, n_out, n_in", [(16, 64, 128), (16, 33, 64), (64, 70, 48), (256, 32, 16), (256, 130, 64)])
def test_tile_layout(K, n_out, n_in):
    ct = C.random_codebook_tensor(n_out, n_in, K, seed=n_out)
    tiled, cbt = C.tile(ct)
    assert tiled.dtype == torch.int32 and tiled.dim() == 1
    rbs = math.ceil(n_out / 32)
    nbytes = ct.codes.shape[1]
    nchunks = nbytes // 16
    b = tiled.view(torch.uint8)
    assert b.numel() == rbs * 32 * nbytes
    codes = torch.cat([ct.codes, ct.codes.new_zeros(rbs * 32 - n_out, nbytes)])
    for rb in range(rbs):
        for j in range(nchunks):
            for lane in range(32):
                start = ((rb * nchunks + j) * 32 + lane) * 16
                assert torch.equal(b[start : start + 16], codes[rb * 32 + lane, j * 16 : j * 16 + 16]), (rb, j, lane)
    assert torch.equal(C.untile(tiled, n_out, nbytes), ct.codes)  # the inverse, padding dropped
    with pytest.raises(ValueError, match="tiled codes hold"):
        C.untile(tiled, n_out + 32, nbytes)
    # codebooks: (row-blocks, K, 32) with cbt[rb, k, lane] = codebook[rb*32 + lane, k], zero-padded
    assert cbt.shape == (rbs, K, 32) and cbt.dtype == torch.float16
    for row in (0, n_out - 1):
        assert torch.equal(cbt[row // 32, :, row % 32], ct.codebook[row])
    if n_out % 32:
        assert not cbt[-1, :, n_out % 32 :].any()


# -- files ------------------------------------------------------------------------------------
@pytest.fixture(params=KS)
def saved(request, tmp_path):
    ct = C.random_codebook_tensor(40, 64, request.param, seed=request.param)
    path = ct.save(tmp_path / f"layer-k{request.param}.safetensors")
    return ct, path


def test_save_load_round_trip(saved):
    ct, path = saved
    back = CodebookTensor.load(path)
    assert (back.K, back.in_features, back.out_features) == (ct.K, ct.in_features, ct.out_features)
    assert torch.equal(back.codes, ct.codes) and torch.equal(back.codebook, ct.codebook)
    assert torch.equal(back.dequantize(), ct.dequantize())


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no codebook file"):
        CodebookTensor.load(tmp_path / "absent.safetensors")


def test_truncated_file_is_refused(saved):
    _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CodebookFormatError, match="truncated or corrupt"):
        CodebookTensor.load(path)


def _data_start(data: bytes) -> int:
    """Byte offset of a safetensors file's tensor data: 8-byte length, then the JSON header."""
    return 8 + int.from_bytes(data[:8], "little")


@pytest.mark.parametrize("tensor", ["codes", "codebook"])
def test_tampered_tensor_bytes_fail_the_sha256(saved, tensor):
    _, path = saved
    data = bytearray(path.read_bytes())
    header = json.loads(data[8:_data_start(data)])
    lo, hi = header[tensor]["data_offsets"]
    i = _data_start(data) + (lo + hi) // 2
    data[i] ^= 0x01  # the low bit: a codebook stays finite, a code stays in range
    path.write_bytes(bytes(data))
    with pytest.raises(CodebookFormatError, match=rf"{tensor} bytes do not match the header's SHA-256"):
        CodebookTensor.load(path)


def _rewrite(path, ct, **header_changes):
    from safetensors.torch import save_file

    h = ct.header()
    h.update(header_changes)
    save_file({"codes": ct.codes, "codebook": ct.codebook}, str(path), metadata={"trapetum": json.dumps(h)})


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"K": 64, "packing": "u8"}, "codes shape"),  # claims uint8 codes, holds 4-bit ones
        ({"K": 64}, "packing '4bit-lo' does not fit K=64"),
        ({"K": 32}, "K=32 is not one of"),
        ({"in_features": 128}, "codes shape"),
        ({"out_features": 41}, "codes shape"),
        ({"codes_shape": [40, 64]}, "codes shape .* != header"),
        ({"format_version": 2}, "format_version 2"),
        ({"kind": "vector-codebook"}, "kind 'vector-codebook'"),
        ({"K": None}, "header lacks K"),
    ],
)
def test_edited_header_is_refused(tmp_path, changes, match):
    ct = C.random_codebook_tensor(40, 64, 16)
    path = tmp_path / "edited.safetensors"
    _rewrite(path, ct, **changes)
    with pytest.raises(CodebookFormatError, match=match):
        CodebookTensor.load(path)


def test_header_claiming_a_smaller_K_is_refused(tmp_path):
    # A K=256 file relabelled K=64: same u8 packing, codes beyond 64 and a 256-wide codebook.
    ct = C.random_codebook_tensor(40, 64, 256)
    path = tmp_path / "relabelled.safetensors"
    _rewrite(path, ct, K=64)
    with pytest.raises(CodebookFormatError, match=r"codebook shape|out of range"):
        CodebookTensor.load(path)


def test_file_without_trapetum_header_is_refused(tmp_path):
    from safetensors.torch import save_file

    ct = C.random_codebook_tensor(40, 64, 16)
    path = tmp_path / "plain.safetensors"
    save_file({"codes": ct.codes, "codebook": ct.codebook}, str(path))
    with pytest.raises(CodebookFormatError, match="no 'trapetum' header"):
        CodebookTensor.load(path)


def test_file_with_extra_tensor_is_refused(tmp_path):
    from safetensors.torch import save_file

    ct = C.random_codebook_tensor(40, 64, 16)
    path = tmp_path / "extra.safetensors"
    save_file({"codes": ct.codes, "codebook": ct.codebook, "bias": torch.zeros(40)}, str(path), metadata={"trapetum": json.dumps(ct.header())})
    with pytest.raises(CodebookFormatError, match="expected tensors codes and codebook"):
        CodebookTensor.load(path)


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"definitely not safetensors")
    with pytest.raises(CodebookFormatError):
        CodebookTensor.load(path)
