"""The served input rotation (trapetum.hadamard) and rotated layers end to end (quantize, forward, save, load, fuse)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from trapetum import gemv, hadamard
from trapetum.hadamard import Rotation, factors, fwht
from trapetum.qlinear import (CONFIG_FILE, QLinear, QuantizedModelError, load_quantized, qlinears, quantize_model,
                              save_quantized)
from test_qlinear import tiny_llama, tiny_llama_256


@pytest.mark.parametrize("n", [2, 64, 96, 344, 576, 1536])
def test_the_rotation_is_orthogonal_and_its_fast_form_is_the_dense_one(n):
    r = Rotation(n, seed=3)
    U = r.matrix()
    assert torch.allclose(U @ U.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    assert r.m * r.p == n and r.p & (r.p - 1) == 0 and r.m % 2 == 1  # p: the largest power of two dividing n
    x = torch.randn(3, 2, n)
    torch.testing.assert_close(r.reference(x).double(), x.double() @ U.T, atol=1e-5, rtol=0)
    # incoherent: no input channel keeps its own weight (every entry of U is small)
    assert U.abs().max() < 3 / math.sqrt(r.p)
    assert not torch.equal(Rotation(n, seed=4).matrix(), U)  # the seed picks the signs (and B)


def test_fwht_is_sylvesters_matrix_and_powers_of_two_match_the_accuracy_pipelines():
    H = torch.ones(1, 1)
    while H.shape[0] < 16:
        H = torch.kron(H, torch.tensor([[1.0, 1.0], [1.0, -1.0]]))
    v = torch.randn(5, 16)
    torch.testing.assert_close(fwht(v), v @ H)
    with pytest.raises(ValueError, match="power of two"):
        fwht(torch.randn(12))
    # where both constructions pick the same odd factor (a power of two: none), they are one matrix
    torch.testing.assert_close(Rotation(256, 3).matrix(torch.float32), hadamard.random_rotation(256, 3), atol=1e-6, rtol=0)


@pytest.mark.parametrize("n", [64, 96, 344, 1536, 2048])
def test_the_kernels_factors_are_the_rotations(n):
    # kron(B, H_p) = kron(B', H_p') with runs of at most RUN: Sylvester's H_p is kron(H_f, H_p')
    B, p, _ = factors(n, seed=5)
    Bk, pk = hadamard.launch_factors(B, p)
    assert pk <= hadamard.RUN and pk & (pk - 1) == 0 and Bk.shape == (n // pk, n // pk) and Bk.dtype == torch.float32
    torch.testing.assert_close(torch.kron(Bk.double(), hadamard.hadamard(pk).double()),
                               torch.kron(B.double(), hadamard.hadamard(p).double()), atol=1e-5, rtol=0)


def test_rotation_bad_inputs():
    for n in (7, 0, 1):
        with pytest.raises(ValueError, match="even number of inputs"):
            factors(n)
    r = Rotation(64)
    with pytest.raises(ValueError, match=r"\(\.\.\., 64\)"):
        r(torch.randn(2, 32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        r([1.0] * 64)
    x = torch.randn(2, 64).half()
    with pytest.raises(ValueError, match="contiguous float16"):
        r.launcher(x.float(), x)
    with pytest.raises(ValueError, match="contiguous float16"):
        r.launcher(x, torch.empty(2, 32).half())


@pytest.mark.skipif(not gemv.SIM, reason="the kernel on CPU tensors needs the CUDA simulator")
@pytest.mark.parametrize("n", [64, 96, 128, 344, 384, 536])
def test_rotation_kernel_matches_the_float64_transform(n):
    # A block a run of at most hadamard.RUN (64 in the simulator, whose blocks have 32 threads, a pair a thread):
    # 64, one run, three radix-4 passes; 128 = 2 runs of 64 (H_2 as B'); 384 = (3 x 2) x 64; 96 = 3 x 32, two threads a
    # pair; 344 = 43 x 8, eight threads share a pair's 43 terms (one radix-4 pass, one radix-2); 536 = 67 x 8, each
    # thread's 9 terms in two groups of loads
    r = Rotation(n, seed=1)
    x = (torch.randn(3, n) * torch.linspace(0.1, 30, n)).half()  # loud channels, as a layer's inputs have
    y = torch.full_like(x, float("nan"))  # poisoned: every output must be written
    r.launcher(x, y)()
    ref = x.double() @ r.matrix().T
    assert torch.isfinite(y).all()
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 2e-3
    torch.testing.assert_close(r(x, simulate=True), y, rtol=0, atol=0)


def test_a_rotated_layer_applies_its_codes_to_the_rotated_input():
    torch.manual_seed(0)
    m = tiny_llama(seed=3)
    dense = {n: lin.weight.detach().clone() for n, lin in m.named_modules() if isinstance(lin, torch.nn.Linear)}
    s = quantize_model(m, K=16, iters=4, progress=False, rotate=True, seed=2)
    assert s["rotate"] and all(spec["rotation"] == 2 for spec in s["layers"].values())
    for name, q in qlinears(m).items():
        assert q.rotation == 2 and "rotation=2" in repr(q)
        x = torch.randn(3, q.in_features)
        W = q.effective_weight(torch.float64)
        torch.testing.assert_close(q(x).double(), x.double() @ W.T, atol=1e-5, rtol=1e-5)
        # the codes were fitted to W U^T: the effective weight is close to the layer's own, as the summary says
        err = float((W.float() - dense[name]).pow(2).sum() / dense[name].pow(2).sum())
        assert err == pytest.approx(s["rel_mse"][name], rel=1e-3) and err < 0.05
        assert not torch.allclose(q.dequantize(torch.float32), dense[name], atol=0.05)  # stored in the rotated basis


def test_a_rotated_model_saves_loads_and_refuses_a_bad_rotation(tmp_path):
    m = tiny_llama(seed=4)
    quantize_model(m, K=16, iters=2, progress=False, rotate=True, seed=5)
    folder = save_quantized(m, tmp_path / "q")
    m2 = load_quantized(folder)
    assert all(q.rotation == 5 for q in qlinears(m2).values())
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m2(ids).logits, m(ids).logits, rtol=0, atol=0)
    h = json.loads((folder / CONFIG_FILE).read_text())
    for bad in ("5", -1, True, 1.5):
        h["layers"]["model.layers.0.self_attn.q_proj"]["rotation"] = bad
        (folder / CONFIG_FILE).write_text(json.dumps(h))
        with pytest.raises(QuantizedModelError, match="'rotation' is a non-negative integer seed"):
            load_quantized(folder)


def test_fusion_keeps_one_rotation_a_group_and_refuses_mixed_ones():
    from trapetum.fuse import fuse_projections

    m = tiny_llama_256(seed=2)
    quantize_model(m, K="A2", iters=1, progress=False, joint=True, rotate=True)
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(ids).logits
    report = fuse_projections(m)
    assert report["model.layers.0.self_attn.qkv_proj"] == "fused"
    assert m.model.layers[0].self_attn.qkv_proj.linear.rotation == 0
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, want, rtol=1e-5, atol=1e-5)
    u = tiny_llama_256(seed=2)
    quantize_model(u, K="A2", iters=1, progress=False, joint=True, rotate=True)
    u.model.layers[0].self_attn.k_proj.rotation = None
    assert fuse_projections(u)["model.layers.0.self_attn.qkv_proj"] == "different input rotations"


def test_finetuning_a_rotated_model_trains_through_the_rotation():
    calib = torch.randint(0, 96, (8, 24), generator=torch.Generator().manual_seed(3))
    plain, m = tiny_llama(seed=8), tiny_llama(seed=8)
    quantize_model(plain, K=16, iters=4, progress=False, calib=calib, batch_size=3, rotate=True)
    s = quantize_model(m, K=16, iters=4, progress=False, calib=calib, batch_size=3, rotate=True,
                       finetune=dict(epochs=4, lr=1e-2, batch=4))
    assert s["finetune"]["kl_after"] < s["finetune"]["kl_before"]
    before = qlinears(plain)
    for name, q in qlinears(m).items():
        assert q.rotation == 0 and torch.equal(q.codes, before[name].codes)  # the same rotated codes, trained codebooks
        x = torch.randn(2, q.in_features)
        torch.testing.assert_close(q(x).double(), x.double() @ q.effective_weight(torch.float64).T, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not gemv.SIM, reason="the kernel dispatch on CPU tensors needs the CUDA simulator")
def test_a_rotated_layer_in_the_simulator_rotates_then_runs_its_kernel():
    from trapetum.codebook import random_codebook_tensor

    q = QLinear.from_codebook(random_codebook_tensor(32, 64, 16, seed=5))
    q.rotation, q.simulate = 7, True
    W = q.effective_weight(torch.float32)
    for rows in (1, 17):  # the fused kernel, then dequantize + matmul: both after the rotation
        x = torch.randn(rows, 64).half()
        torch.testing.assert_close(q(x).float(), x.float() @ W.T, atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()  # earlier tests' compiles of QLinear.forward count against dynamo's recompile limit
    got = torch.compile(q, backend="aot_eager", fullgraph=True)(x)  # the rotation is an opaque op too
    torch.testing.assert_close(got, q(x))
    with pytest.raises(RuntimeError, match="no QLinear is registered"):
        torch.ops.trapetum.qlinear_rotate(x, 12345)


@pytest.mark.skipif(not gemv.SIM, reason="the fused step's kernels run in the CUDA simulator")
@pytest.mark.parametrize("K, rotate", [(16, True), ("A2", True), (16, "stream")])
def test_the_fused_step_rotates_before_its_gemvs_and_matches_the_eager_path(K, rotate):
    # The rotation launch takes each GEMV's pre-operation (RMSNorm, SiLU x up): one launch more a projection group
    from trapetum.decode import FakeGraphRunner, check_equivalence
    from trapetum.step import FusedStep

    m = tiny_llama_256(seed=5) if K == "A2" else tiny_llama(seed=5)
    quantize_model(m, K=K, iters=2, progress=False, rotate=rotate, joint=K == "A2")
    m.half()
    for q in qlinears(m).values():
        q.simulate = True
    r = check_equivalence(m, torch.tensor([[3, 17, 42, 8, 61]]), n=6, runner=FakeGraphRunner(), path="fused-step")
    assert r["first_mismatch"] is None and r["max_rel_logit_diff"] < 1e-2, r
    step = FusedStep(m, max_len=16, n=4)
    layers = len(m.model.layers)
    assert step.unfused_projections == ["lm_head"]
    if rotate is True:
        assert step.rotation_launches == 4 * layers
        assert sorted({k.split(" ")[1] for k in step.plans}) == ["-/-", "-/add"]  # the GEMVs' own prologues: none
    else:  # the stream rotated offline: q/k/v and gate/up keep their RMSNorm prologue, down's rotation takes the SiLU
        assert step.rotation_launches == layers
        assert "rms/-" in {k.split(" ")[1] for k in step.plans}


@pytest.mark.skipif(not gemv.SIM, reason="the kernel on CPU tensors needs the CUDA simulator")
@pytest.mark.parametrize("n", [64, 344, 384])
def test_the_rotation_launch_takes_the_steps_pre_operations(n):
    import torch.nn.functional as F

    r, U = Rotation(n, seed=2), None
    U = r.matrix()
    x, w = torch.randn(2, n).half(), (1 + 0.3 * torch.randn(n)).half()
    y = torch.full((2, n), float("nan")).half()
    r.launcher(x, y, pre="rms", norm_weight=w, eps=1e-5)()
    ref = (x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()) @ U.T
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 2e-3
    gu = torch.randn(2, 2 * n).half()
    y = torch.full((2, n), float("nan")).half()
    r.launcher(gu, y, pre="silu")()
    ref = (F.silu(gu.double()[:, :n]) * gu.double()[:, n:]) @ U.T
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 2e-3
    with pytest.raises(ValueError, match="norm's contiguous float16"):
        r.launcher(x, y, pre="rms")
    with pytest.raises(ValueError, match=r"\(rows, %d\)" % (2 * n)):
        r.launcher(x, y, pre="silu")
    with pytest.raises(ValueError, match="pre must be one of"):
        r.launcher(x, y, pre="gelu")


def _loud_norms(m, seed=0):
    # trained norms are far from 1, and what folding them into the layers must keep
    g = torch.Generator().manual_seed(seed)
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            p.data = 1 + 0.5 * torch.randn(p.shape, generator=g)
    return m


@pytest.mark.parametrize("tie, bias", [(False, False), (True, True)])
def test_rotating_the_residual_stream_keeps_the_models_function(tie, bias):
    m = _loud_norms(tiny_llama(seed=6, tie=tie, bias=bias))
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = m(ids).logits
        h_before = m.model.embed_tokens(ids)
    info = hadamard.rotate_residual(m, seed=3)
    assert info == {"seed": 3, "hidden": 64, "head_dim": 16}
    with torch.no_grad():
        got = m(ids).logits
        h_after = m.model.embed_tokens(ids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # the stream itself is rotated: the embedding is Q e, and the norms' weights are now in the layers
    torch.testing.assert_close(h_after.double(), h_before.double() @ Rotation(64, 3).matrix().T, atol=1e-6, rtol=0)
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in m.named_parameters() if n.endswith("norm.weight"))
    assert m.lm_head.weight is not m.model.embed_tokens.weight and not m.config.tie_word_embeddings


def test_rotate_residual_refuses_what_it_cannot_rotate():
    from torch import nn

    m = tiny_llama(seed=1)
    quantize_model(m, K=16, iters=1, progress=False, exclude=["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.gate_proj", "*.up_proj"])
    with pytest.raises(ValueError, match="layer 0's down_proj is QLinear"):
        hadamard.rotate_residual(m)
    m = tiny_llama(seed=1)
    m.model.norm = nn.LayerNorm(64)
    with pytest.raises(ValueError, match="RMSNorm .* the final norm is LayerNorm"):
        hadamard.rotate_residual(m)
    with pytest.raises(ValueError, match="rotate is False, True or 'stream'"):
        quantize_model(tiny_llama(), K=16, rotate="inputs")


def test_a_stream_rotated_model_rotates_only_down_projs_inputs_and_saves_loads(tmp_path):
    m, ref = _loud_norms(tiny_llama(seed=4, tie=True)), _loud_norms(tiny_llama(seed=4, tie=True))
    s = quantize_model(m, K=16, iters=4, progress=False, rotate="stream", seed=5)
    assert s["rotate"] == "stream" and s["stream_rotation"]["seed"] == 5
    rotated = {n for n, spec in s["layers"].items() if "rotation" in spec}
    assert rotated == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    assert all(q.rotation == (5 if n in rotated else None) for n, q in qlinears(m).items())
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # close to the unrotated fp32 model it came from (4-bit codes), not equal
        a, b = m(ids).logits, ref(ids).logits
    assert 0 < float((a - b).abs().max()) < 0.5 * float(b.abs().max())
    folder = save_quantized(m, tmp_path / "q")
    m2 = load_quantized(folder)
    assert not m2.config.tie_word_embeddings and m2.lm_head.weight.data_ptr() != m2.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(m2(ids).logits, a, rtol=0, atol=0)
