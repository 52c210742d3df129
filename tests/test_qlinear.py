"""QLinear and whole-model quantize / save / load on a tiny random Llama (CPU dequant path)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from trapetum import gemv, qlinear
from trapetum.codebook import random_codebook_tensor
from trapetum.qlinear import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    QEmbedding,
    QLinear,
    QuantizedModelError,
    load_quantized,
    qlinears,
    quantize_model,
    save_quantized,
    set_mode,
)


def tiny_llama(seed=0, tie=False, bias=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=128, tie_word_embeddings=tie,
                      attention_bias=bias, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def quantized():
    m = tiny_llama()
    summary = quantize_model(m, K=16, iters=4, progress=False)
    return m, summary


def test_quantize_model_swaps_every_decoder_projection(quantized):
    m, summary = quantized
    q = qlinears(m)
    assert len(q) == 2 * 7 and set(q) == set(summary["layers"])
    assert isinstance(m.lm_head, nn.Linear) and isinstance(m.model.embed_tokens, nn.Embedding)
    assert all(v < 0.05 for v in summary["rel_mse"].values())
    assert all(mod.codebook.dtype == torch.float16 and mod.codes.dtype == torch.uint8 for mod in q.values())


def test_exclusions_by_pattern_and_size():
    m = tiny_llama()
    s = quantize_model(m, K=16, exclude=["*.down_proj"], min_features=64, iters=2, progress=False)
    # k_proj/v_proj are 64 -> 32 (2 KV heads of 16): below min_features=64.
    assert sorted(s["excluded"]) == sorted(f"model.layers.{i}.{n}" for i in range(2) for n in ("mlp.down_proj", "self_attn.k_proj", "self_attn.v_proj"))
    assert isinstance(m.model.layers[0].mlp.down_proj, nn.Linear)
    assert isinstance(m.model.layers[1].self_attn.q_proj, QLinear)


def test_qlinear_cpu_forward_is_the_dequantized_linear():
    ct = random_codebook_tensor(48, 64, 16, seed=3)
    b = torch.randn(48)
    q = QLinear.from_codebook(ct, bias=b)
    x = torch.randn(2, 5, 64)
    ref = x @ ct.dequantize(torch.float32).T + b.half().float()
    torch.testing.assert_close(q(x), ref)


def test_dtype_moves_keep_the_format(quantized):
    m, _ = quantized
    m.float()
    q = next(iter(qlinears(m).values()))
    assert q.codebook.dtype == torch.float16 and q.codes.dtype == torch.uint8


def test_qlinear_bad_inputs():
    q = QLinear.from_codebook(random_codebook_tensor(32, 64, 16))
    with pytest.raises(ValueError, match="expects"):
        q(torch.randn(3, 32))
    with pytest.raises(TypeError):
        q([1.0] * 64)
    with pytest.raises(ValueError, match="K must be one of"):
        QLinear(64, 32, K=32)
    with pytest.raises(ValueError, match="divisible"):
        QLinear(48, 32, K=16)
    with pytest.raises(ValueError, match="mode"):
        set_mode(nn.Sequential(q), "fastest")
    with pytest.raises(ValueError, match="bias shape"):
        QLinear.from_codebook(random_codebook_tensor(32, 64, 16), bias=torch.zeros(5))


def test_quantize_model_rejects_non_llama():
    with pytest.raises(Exception, match="causal LM|layers"):
        quantize_model(nn.Linear(64, 64), progress=False)


@pytest.mark.skipif(not gemv.SIM, reason="the kernel dispatch on CPU tensors needs the CUDA simulator")
@pytest.mark.parametrize("mode", ["fast", "naive"])
def test_kernel_dispatch_in_simulator(mode):
    # Tiny shapes: every simulated CUDA thread is a Python thread.
    ct = random_codebook_tensor(32, 64, 16, seed=5)
    q = QLinear.from_codebook(ct, bias=torch.randn(32))
    q.simulate, q.mode = True, mode
    W = ct.dequantize(torch.float32)
    for rows in (1, 17, 65):  # fused kernels (17: the wide one), then dequantize + matmul
        x = torch.randn(rows, 64).half()
        y = q(x)
        assert y.dtype == torch.float16 and y.shape == (rows, 32)
        torch.testing.assert_close(y.float(), x.float() @ W.T + q.bias.float(), atol=2e-2, rtol=2e-2)
    if mode == "fast":
        with pytest.raises(TypeError, match="float16"):
            q(torch.randn(1, 64))


@pytest.mark.skipif(not gemv.SIM, reason="the kernel dispatch on CPU tensors needs the CUDA simulator")
def test_large_batches_rebuild_the_weight_a_slab_at_a_time(monkeypatch):
    # 70 rows in slabs of 32 (the last one partial): the same product as the whole weight at once.
    ct = random_codebook_tensor(70, 64, 16, seed=6)
    q = QLinear.from_codebook(ct)
    q.simulate = True
    monkeypatch.setattr(qlinear, "SLAB_BYTES", 32 * 2 * 64)
    slabs = []
    g = q.gemv()
    real = g.dequantize
    monkeypatch.setattr(g, "dequantize", lambda rows: slabs.append(rows) or real(rows=rows))
    x = torch.randn(65, 64).half()  # past every fused kernel's batch
    y = q(x)
    assert slabs == [(0, 32), (32, 64), (64, 70)]
    torch.testing.assert_close(y.float(), x.float() @ ct.dequantize(torch.float32).T, atol=2e-2, rtol=2e-2)


def _check_codes_held_once(q, x, natural):
    """Run q on x in the simulator; its natural codes must be released yet still read back. Returns q(x)."""
    q.simulate = True
    y0 = q(x)
    assert q.codes.numel() == 0, "the natural codes buffer should be released once the tiled copy exists"
    assert torch.equal(q.state_dict()["codes"], natural)
    ct = q.codebook_tensor()
    assert torch.equal(ct.indices if hasattr(ct, "indices") else ct.codes, natural)  # a residual layer's codes are its index words
    torch.testing.assert_close(q(x), y0)
    return y0


@pytest.mark.skipif(not gemv.SIM, reason="the kernel dispatch on CPU tensors needs the CUDA simulator")
def test_codes_held_once_once_the_kernel_is_built():
    # Out of 40 rows: not a multiple of the kernel's 32-row blocks, so untiling must drop the padding.
    ct = random_codebook_tensor(40, 64, 16, seed=6)
    natural = ct.codes.clone()
    q = QLinear.from_codebook(ct)
    x = torch.randn(1, 64).half()
    _check_codes_held_once(q, x, natural)
    assert torch.equal(q.dequantize(), ct.dequantize())
    q2 = QLinear(64, 40, 16)
    q2.load_state_dict(q.state_dict())
    assert torch.equal(q2.codes, natural)
    q.load_state_dict({"codes": torch.zeros_like(natural), "codebook": q.codebook})  # a load replaces the kernel's copy
    assert torch.equal(q.codes, torch.zeros_like(natural)) and q._gemv is None
    q(x)
    q.float()  # a move brings the natural buffer back
    assert torch.equal(q.codes, torch.zeros_like(natural))


@pytest.mark.skipif(not gemv.SIM, reason="the kernel dispatch on CPU tensors needs the CUDA simulator")
def test_the_fused_kernel_is_one_opaque_op_under_torch_compile():
    # fullgraph: the custom op and its shape-only fake must trace with no graph break.
    ct = random_codebook_tensor(48, 64, 16, seed=7)
    q = QLinear.from_codebook(ct, bias=torch.randn(48))
    q.simulate = True
    x = torch.randn(2, 64).half()
    want = q(x)
    torch._dynamo.reset()  # earlier tests' compiles of QLinear.forward count against dynamo's recompile limit
    got = torch.compile(q, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError, match="no QLinear is registered"):
        torch.ops.trapetum.qlinear_gemv(x, 12345)


# -- save / load -----------------------------------------------------------------------------------
@pytest.fixture()
def saved(tmp_path):
    m = tiny_llama(seed=1, tie=True, bias=True)
    quantize_model(m, K=16, iters=2, progress=False)
    folder = save_quantized(m, tmp_path / "q")
    return m, folder


def test_save_load_round_trip(saved):
    m, folder = saved
    m2 = load_quantized(folder)
    assert set(qlinears(m2)) == set(qlinears(m))
    assert m2.lm_head.weight is m2.model.embed_tokens.weight  # tied again
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m2(ids).logits, m(ids).logits, rtol=0, atol=0)
    h = json.loads((folder / CONFIG_FILE).read_text())
    assert h["layers"]["model.layers.0.self_attn.q_proj"] == {"K": 16, "in_features": 64, "out_features": 64, "bias": True}


def test_load_rejects_truncated_file(saved):
    _, folder = saved
    p = folder / WEIGHTS_FILE
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with pytest.raises(QuantizedModelError, match="truncated or corrupt"):
        load_quantized(folder)


def test_load_rejects_tampered_tensor(saved):
    _, folder = saved
    p = folder / WEIGHTS_FILE
    b = bytearray(p.read_bytes())
    b[-3] ^= 0xFF  # inside the last tensor's data
    p.write_bytes(bytes(b))
    with pytest.raises(QuantizedModelError, match="SHA-256"):
        load_quantized(folder)


@pytest.mark.parametrize("edit, match", [
    (lambda h: h.update(format_version=99), "format_version"),
    (lambda h: h.update(kind="something"), "kind"),
    (lambda h: h["layers"]["model.layers.0.mlp.up_proj"].update(K=32), "K=32"),
    (lambda h: h["layers"]["model.layers.0.mlp.up_proj"].update(in_features=96), "model.layers.0.mlp.up_proj"),
    (lambda h: h["layers"].update({"model.layers.0.mlp.nothing": {"K": 16, "in_features": 64, "out_features": 64, "bias": False}}), "does not exist"),
    (lambda h: h["tensors"].pop("model.norm.weight"), "unexpected"),
    (lambda h: h.pop("base_config"), "base_config"),
])
def test_load_rejects_mismatched_config(saved, edit, match):
    load_edited(saved[1], edit, match)


def load_edited(folder, edit, match):
    """Edit a saved model's trapetum.json with ``edit``; loading it must fail with ``match``."""
    p = folder / CONFIG_FILE
    h = json.loads(p.read_text())
    edit(h)
    p.write_text(json.dumps(h))
    with pytest.raises(QuantizedModelError, match=match):
        load_quantized(folder)


def test_load_rejects_bad_json_and_missing_files(saved, tmp_path):
    _, folder = saved
    with pytest.raises(FileNotFoundError, match="trapetum.json"):
        load_quantized(tmp_path)
    (folder / CONFIG_FILE).write_text("{not json")
    with pytest.raises(QuantizedModelError, match="JSON"):
        load_quantized(folder)


@pytest.fixture()
def saved_with_embedding(tmp_path):
    m = tiny_llama(seed=2, tie=True)
    head = m.lm_head.weight.detach().clone()
    summary = quantize_model(m, K=16, iters=2, progress=False, embedding=True)
    assert isinstance(m.model.embed_tokens, QEmbedding) and "model.embed_tokens" in summary["rel_mse"]
    assert torch.equal(m.lm_head.weight, head)  # the head keeps the fp16 weight it shared; the tie ends
    return m, save_quantized(m, tmp_path / "qe")


def test_save_load_round_trip_with_a_codebook_embedding(saved_with_embedding):
    m, folder = saved_with_embedding
    h = json.loads((folder / CONFIG_FILE).read_text())
    assert h["embeddings"] == {"model.embed_tokens": {"K": 16, "num_embeddings": 96, "embedding_dim": 64, "padding_idx": None}}
    m2 = load_quantized(folder)
    assert isinstance(m2.model.embed_tokens, QEmbedding) and m2.trapetum_quant["embeddings"] == h["embeddings"]
    assert m2.model.embed_tokens.codebook.dtype == torch.float16
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m2(ids).logits, m(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("edit, match", [
    (lambda h: h["embeddings"]["model.embed_tokens"].update(K=17), "K=17"),
    (lambda h: h["embeddings"]["model.embed_tokens"].update(padding_idx=96), "padding_idx"),
    (lambda h: h["embeddings"]["model.embed_tokens"].update(embedding_dim=32), "model.embed_tokens"),
    (lambda h: h["embeddings"]["model.embed_tokens"].pop("num_embeddings"), "lacks"),
    (lambda h: h["embeddings"].update({"model.nothing": {"K": 16, "num_embeddings": 96, "embedding_dim": 64, "padding_idx": None}}), "does not exist"),
    (lambda h: h.update(embeddings=[]), "not a dict"),
])
def test_load_rejects_a_mismatched_embedding(saved_with_embedding, edit, match):
    load_edited(saved_with_embedding[1], edit, match)


def test_save_refuses_an_unquantized_model(tmp_path):
    with pytest.raises(ValueError, match="quantize_model"):
        save_quantized(tiny_llama(), tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(gemv.SIM or not torch.cuda.is_available(), reason="needs a CUDA GPU and NUMBA_ENABLE_CUDASIM=0")
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_qlinear_on_gpu_matches_dequantized(rows):
    ct = random_codebook_tensor(300, 256, 16, seed=rows, device="cuda")
    q = QLinear.from_codebook(ct, bias=torch.randn(300, device="cuda"))
    x = torch.randn(rows, 256, device="cuda").half()
    ref = x.double() @ ct.dequantize(torch.float64).T + q.bias.double()
    for mode in ("fast", "naive"):
        q.mode = mode
        y = q(x)
        assert y.dtype == torch.float16
        assert (y.double() - ref).abs().max() <= 2e-3 * ref.abs().max()


# -- additive codebook layers ----------------------------------------------------------------------
def test_additive_qlinear_matches_its_dequantized_weight():
    from trapetum.additive import random_additive_tensor
    from trapetum.qlinear import AdditiveQLinear

    t = random_additive_tensor(40, 128, 2, seed=4)
    q = AdditiveQLinear.from_additive(t, bias=torch.randn(40))
    x = torch.randn(3, 128)
    W = t.dequantize(torch.float32)
    torch.testing.assert_close(q(x), x @ W.T + q.bias.float(), atol=1e-4, rtol=1e-4)
    assert q.bits_per_weight == pytest.approx(t.bits_per_weight) and "M=2" in repr(q)
    q.float()
    assert q.codebooks.dtype == torch.float16 and q.scales.dtype == torch.float16  # the format survives model.float()
    with pytest.raises(ValueError, match="M"):
        AdditiveQLinear(128, 40, M=3)
    with pytest.raises(ValueError, match="divisible"):
        AdditiveQLinear(100, 40, M=2)


@pytest.mark.skipif(not gemv.SIM, reason="the kernel dispatch on CPU tensors needs the CUDA simulator")
def test_additive_qlinear_kernel_dispatch_in_simulator():
    from trapetum.additive import random_additive_tensor
    from trapetum.qlinear import AdditiveQLinear

    t = random_additive_tensor(32, 64, 2, seed=5)
    q = AdditiveQLinear.from_additive(t)
    q.simulate = True
    x = torch.randn(1, 64).half()
    torch.testing.assert_close(q(x).float(), x.float() @ t.dequantize(torch.float32).T, atol=2e-2, rtol=2e-2)


def tiny_llama_256(seed=0):
    # in_features multiples of 256: what residual codebooks (whole chunks of 32 vectors) take
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=96, max_position_embeddings=64, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("K, cls", [("A2", "AdditiveQLinear"), ("R4096+256", "ResidualQLinear")])
def test_quantize_save_load_round_trip_of_vector_codebook_models(tmp_path, K, cls):
    m = tiny_llama_256()
    ref = tiny_llama_256()
    s = quantize_model(m, K=K, iters=1, progress=False, exclude=["*.down_proj"])
    q = qlinears(m)
    assert len(q) == 6 and {type(v).__name__ for v in q.values()} == {cls} and s["K"] == K
    assert all(0 < e < 0.5 for e in s["rel_mse"].values())
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the quantized model is close to the fp32 one it came from, not equal
        a, b = m(ids).logits, ref(ids).logits
    assert 0 < (a - b).abs().max() < 0.5 * b.abs().max()
    folder = save_quantized(m, tmp_path / "q")
    spec = json.loads((folder / CONFIG_FILE).read_text())["layers"]["model.layers.0.self_attn.k_proj"]
    assert spec == {"K": K, "in_features": 256, "out_features": 128, "bias": False, **({"norm": False} if K.startswith("R") else {})}
    m2 = load_quantized(folder)
    assert {n: type(v).__name__ for n, v in qlinears(m2).items()} == {n: cls for n in q}
    with torch.no_grad():
        torch.testing.assert_close(m2(ids).logits, a, rtol=0, atol=0)
    assert isinstance(m2.model.layers[0].mlp.down_proj, nn.Linear)


def test_calibrated_quantize_model_is_the_accuracy_chapters_kmeans_act():
    # The deployable path with calib gives exactly the weights the chapter's "kmeans-act" pipeline scores
    # (layer by layer, importance-weighted k-means on the inputs the quantized earlier layers give).
    from trapetum import pipelines as P

    calib = torch.randint(0, 96, (4, 24), generator=torch.Generator().manual_seed(3))
    m, ref, plain = tiny_llama(seed=8), tiny_llama(seed=8), tiny_llama(seed=8)
    s = quantize_model(m, K=16, iters=4, progress=False, calib=calib, batch_size=3)
    P.quantize(ref, "kmeans-act", calib, iters=4, progress=False, batch_size=3)
    assert s["calibration_tokens"] == 96 and len(s["layers"]) == 14
    for name, q in qlinears(m).items():
        torch.testing.assert_close(q.dequantize(torch.float32), ref.get_submodule(name).weight, rtol=0, atol=0)
    quantize_model(plain, K=16, iters=4, progress=False)  # uncalibrated: other weights
    assert not torch.equal(qlinears(plain)["model.layers.1.mlp.down_proj"].codebook, qlinears(m)["model.layers.1.mlp.down_proj"].codebook)
    for bad, why in ((calib.float(), "LongTensor"), (calib[0], "LongTensor"), (calib[:0], "non-empty")):
        with pytest.raises(ValueError, match=why):
            quantize_model(tiny_llama(seed=8), K=16, progress=False, calib=bad)
    with pytest.raises(ValueError, match="batch_size"):
        quantize_model(tiny_llama(seed=8), K=16, progress=False, calib=calib, batch_size=0)


def test_finetune_trains_the_codebooks_and_norms_with_the_codes_fixed(tmp_path):
    # quantize_model(finetune=...) is the chapter's kmeans-act with ft_epochs: same codes, trained codebook
    # entries and norms, closer to the unquantized model on the calibration tokens, still a saved-format QLinear
    from trapetum.finetune import kl_to_teacher

    calib = torch.randint(0, 96, (8, 24), generator=torch.Generator().manual_seed(3))
    teacher, plain, m = tiny_llama(seed=8), tiny_llama(seed=8), tiny_llama(seed=8)
    quantize_model(plain, K=16, iters=4, progress=False, calib=calib, batch_size=3, exclude=["*.down_proj"])
    s = quantize_model(m, K=16, iters=4, progress=False, calib=calib, batch_size=3, exclude=["*.down_proj"],
                       finetune=dict(epochs=6, lr=1e-2, batch=4))
    ft = s["finetune"]
    assert ft["epochs"] == 6 and ft["norms"] and ft["kl_after"] < 0.8 * ft["kl_before"] and m.trapetum_quant["finetune"] == ft
    before, after = qlinears(plain), qlinears(m)
    assert set(after) == set(s["layers"]) and len(after) == 12  # down_proj stayed nn.Linear
    for name, q in after.items():
        assert torch.equal(q.codes, before[name].codes)  # the codes are the calibrated quantizer's
        assert q.codebook.dtype == torch.float16 and not torch.equal(q.codebook, before[name].codebook)
    assert torch.equal(m.model.layers[1].mlp.down_proj.weight, plain.model.layers[1].mlp.down_proj.weight)  # excluded: untouched
    assert not torch.equal(m.model.norm.weight, plain.model.norm.weight) and m.model.norm.weight.dtype == torch.float32
    with torch.no_grad():
        kl = {k: float(kl_to_teacher(mm(calib).logits, teacher(calib).logits)) for k, mm in (("plain", plain), ("ft", m))}
    assert kl["ft"] < 0.8 * kl["plain"]
    m2 = load_quantized(save_quantized(m, tmp_path / "q"))  # the trained norms travel with the file, and how it was made
    assert m2.trapetum_quant["finetune"]["kl_after"] == ft["kl_after"] and m2.trapetum_quant["calibration_tokens"] == calib.numel()
    ids = calib[:2, :10]
    with torch.no_grad():
        torch.testing.assert_close(m2(ids).logits, m(ids).logits, rtol=0, atol=0)


def test_finetune_of_an_fp16_model_leaves_every_tensor_in_its_dtype(monkeypatch):
    calib = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(4))
    m = tiny_llama(seed=5).half()

    def refuse(self):  # as transformers' PreTrainedModel.float() does for a model it loaded from GGUF
        raise ValueError("`.float()` is not supported for quantized model")

    monkeypatch.setattr(type(m), "float", refuse)
    quantize_model(m, K=16, iters=2, progress=False, calib=calib, embedding=True, finetune=1)
    dtypes = {n: t.dtype for n, t in m.state_dict().items() if t.is_floating_point()}
    assert set(dtypes.values()) == {torch.float16}, dtypes  # trained in fp32, then cast back
    assert isinstance(m.model.embed_tokens, QEmbedding) and len(qlinears(m)) == 14


def test_finetune_of_additive_layers_keeps_a_joint_group_on_one_codebook_set(tmp_path):
    from trapetum.finetune import kl_to_teacher
    from trapetum.fuse import fuse_projections

    calib = torch.randint(0, 96, (6, 16), generator=torch.Generator().manual_seed(6))
    teacher, plain, m = tiny_llama_256(seed=3), tiny_llama_256(seed=3), tiny_llama_256(seed=3)
    quantize_model(plain, K="A2", iters=1, progress=False, calib=calib, joint=True)
    s = quantize_model(m, K="A2", iters=1, progress=False, calib=calib, joint=True, finetune=dict(epochs=8, batch=3))
    assert s["finetune"]["lr"] == qlinear.FINETUNE_LR["additive"] and s["finetune"]["kl_after"] < 0.8 * s["finetune"]["kl_before"]
    before, after = qlinears(plain), qlinears(m)
    for name, q in after.items():
        assert torch.equal(q.codes, before[name].codes) and q.codebooks.dtype == q.scales.dtype == torch.float16
        assert not torch.equal(q.codebooks, before[name].codebooks) and not torch.equal(q.scales, before[name].scales)
    attn = m.model.layers[0].self_attn
    assert torch.equal(attn.q_proj.codebooks, attn.k_proj.codebooks) and torch.equal(attn.q_proj.codebooks, attn.v_proj.codebooks)
    with torch.no_grad():
        kl = [float(kl_to_teacher(mm(calib).logits, teacher(calib).logits)) for mm in (plain, m)]
    assert kl[1] < 0.8 * kl[0]
    m2 = load_quantized(save_quantized(m, tmp_path / "q"))
    assert set(fuse_projections(m2).values()) == {"fused"}  # the trained group still fuses


def test_finetune_refuses_what_it_cannot_do():
    calib = torch.randint(0, 96, (2, 8))
    for kw, why in ((dict(finetune=2), "needs calib"), (dict(finetune={"epochs": 1, "lr": 1e-3, "steps": 3}, calib=calib), "dict of epochs"),
                    (dict(finetune=-1, calib=calib), "epochs >= 1"), (dict(finetune=True, calib=calib), "number of epochs"),
                    (dict(finetune={"lr": 1e-3}, calib=calib), "epochs >= 1"), (dict(K="R4096+256", finetune=1, calib=calib), "not supported")):
        m = tiny_llama_256(seed=1) if "K" in kw else tiny_llama(seed=1)
        with pytest.raises(ValueError, match=why):
            quantize_model(m, **({"K": 16} | kw), iters=1, progress=False)
        assert not qlinears(m)  # refused before anything was quantized


@pytest.mark.parametrize("K", ["A2", "R4096+256"])
def test_calibrated_vector_codebooks_weigh_by_the_inputs(K):
    m, plain = tiny_llama_256(seed=4), tiny_llama_256(seed=4)
    calib = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
    quantize_model(m, K=K, iters=1, progress=False, calib=calib, joint=True)
    quantize_model(plain, K=K, iters=1, progress=False, joint=True)
    a, b = qlinears(m)["model.layers.0.self_attn.q_proj"], qlinears(plain)["model.layers.0.self_attn.q_proj"]
    books = "codebooks" if K == "A2" else "main"
    assert not torch.equal(getattr(a, books), getattr(b, books))  # H moved the codebooks
    assert torch.equal(getattr(a, books), getattr(qlinears(m)["model.layers.0.self_attn.v_proj"], books))  # still one set a group


@pytest.mark.parametrize("K", ["A2", "R4096+256"])
def test_joint_quantization_shares_codebooks_so_groups_fuse_after_a_reload(tmp_path, K):
    from trapetum.fuse import fuse_projections

    m = tiny_llama_256(seed=2)
    s = quantize_model(m, K=K, iters=1, progress=False, joint=True, exclude=["*.up_proj"])
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    books = "codebooks" if K == "A2" else "main"
    assert torch.equal(getattr(attn.k_proj, books), getattr(attn.q_proj, books)) and s["joint"]
    assert not torch.equal(getattr(attn.o_proj, books), getattr(attn.q_proj, books))  # o is its own group
    assert all(0 < e < 0.5 for e in s["rel_mse"].values()) and len(s["rel_mse"]) == 6
    # gate/up: up excluded, so gate was quantized alone, and the group stays unfused
    m2 = load_quantized(save_quantized(m, tmp_path / "q"))
    report = fuse_projections(m2)
    assert report["model.layers.0.self_attn.qkv_proj"] == "fused" and report["model.layers.0.mlp.gate_up_proj"] == "mixed layer types " + \
        ", ".join(sorted(["Linear", type(mlp.gate_proj).__name__]))
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(m2(ids).logits, m(ids).logits, rtol=1e-5, atol=1e-5)
    # without joint, the separate codebooks keep the group unfused, and the report says why
    u = tiny_llama_256(seed=2)
    quantize_model(u, K=K, iters=1, progress=False)
    assert "different codebooks" in fuse_projections(u)["model.layers.0.self_attn.qkv_proj"]


def test_residual_layers_with_a_norm_round_trip(tmp_path):
    from trapetum.qlinear import ResidualQLinear
    from trapetum.residual import random_residual_tensor

    m = tiny_llama_256()
    name = "model.layers.0.self_attn.q_proj"
    t = random_residual_tensor(256, 256, 4096, 512, seed=3, with_norm=True)
    m.model.layers[0].self_attn.q_proj = ResidualQLinear.from_residual(t)
    m.trapetum_quant = {"K": "R4096+512", "layers": {name: {"K": "R4096+512", "in_features": 256, "out_features": 256, "bias": False,
                                                             "norm": True}}, "excluded": {}, "embeddings": {}}
    folder = save_quantized(m, tmp_path / "q")
    q2 = load_quantized(folder).get_submodule(name)
    assert q2.norm and torch.equal(q2.dequantize(), t.dequantize())
    load_edited(folder, lambda h: h["layers"][name].update(norm=False), "do not fit")  # then norm_scale has no place
    load_edited(folder, lambda h: h["layers"][name].update(norm="yes"), "'norm'")
    load_edited(folder, lambda h: h["layers"][name].update(K="R4096+300"), "Nr must be one of")
    m.trapetum_quant["layers"][name]["norm"] = False
    with pytest.raises(ValueError, match="trapetum_quant says"):
        save_quantized(m, tmp_path / "other")


def test_schemes():
    from trapetum.qlinear import check_scheme_in_features, parse_scheme

    assert parse_scheme(16) == parse_scheme("K16") == ("scalar", (16,))
    assert parse_scheme("A4") == ("additive", (4,)) and parse_scheme("R8192+512") == ("residual", (8192, 512))
    for bad in (32, "K32", "A3", "R4096", "R4096+300", "r4096+256", True, None, 16.0):
        with pytest.raises(ValueError, match="K=32|unknown scheme|Nr must be one of"):
            parse_scheme(bad)
    check_scheme_in_features("A2", 64)
    for K, n_in in (("R4096+256", 128), ("A2", 60), (64, 63)):
        with pytest.raises(ValueError, match="divisible|whole bytes|not"):
            check_scheme_in_features(K, n_in)
    m = tiny_llama()  # hidden 64: no layer takes residual codebooks, and each says why
    s = quantize_model(m, K="R4096+256", progress=False)
    assert not qlinears(m) and all("divisible by 256" in why for why in s["excluded"].values())
    with pytest.raises(ValueError, match="embedding takes scalar"):
        quantize_model(tiny_llama(), K="A2", embedding=True, progress=False)


def test_residual_qlinear_matches_its_dequantized_weight():
    from trapetum.qlinear import ResidualQLinear
    from trapetum.residual import random_residual_tensor

    t = random_residual_tensor(40, 256, 4096, 256, seed=4)
    q = ResidualQLinear.from_residual(t, bias=torch.randn(40))
    x = torch.randn(3, 256)
    torch.testing.assert_close(q(x), x @ t.dequantize(torch.float32).T + q.bias.float(), atol=1e-4, rtol=1e-4)
    assert q.bits_per_weight == pytest.approx(t.bits_per_weight) and "main=4096" in repr(q)
    q.float()
    assert q.main.dtype == q.res.dtype == q.bias.dtype == torch.float16 and q.codes.dtype == torch.int32
    with pytest.raises(ValueError, match="Nm"):
        ResidualQLinear(256, 40, Nm=1000)
    with pytest.raises(ValueError, match="divisible by 256"):
        ResidualQLinear(128, 40)


@pytest.mark.skipif(not gemv.SIM, reason="the kernel dispatch on CPU tensors needs the CUDA simulator")
def test_residual_qlinear_kernel_dispatch_in_simulator(monkeypatch):
    from trapetum.qlinear import ResidualQLinear
    from trapetum.residual import random_residual_tensor

    t = random_residual_tensor(40, 256, 4096, 256, seed=5)  # 40 rows: untiling must drop the row-block padding
    natural = t.indices.clone()
    q = ResidualQLinear.from_residual(t)
    x = torch.randn(1, 256).half()
    W = t.dequantize(torch.float32)
    y0 = _check_codes_held_once(q, x, natural)
    torch.testing.assert_close(y0.float(), x.float() @ W.T, atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(qlinear, "SLAB_BYTES", 32 * 2 * 256)  # past the fused batches: slabs of 32 rows
    x17 = torch.randn(17, 256).half()
    torch.testing.assert_close(q(x17).float(), x17.float() @ W.T, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q.dequantize(), t.dequantize())
    q.float()  # a move brings the natural buffer back
    assert torch.equal(q.codes, natural) and q._gemv is None


@pytest.mark.skipif(not gemv.SIM, reason="the kernel dispatch on CPU tensors needs the CUDA simulator")
def test_additive_codes_held_once_once_the_kernel_is_built():
    # 70B at 2 bits peaked at 39.8 GB for 18.2 GB of weights while the natural codes stayed beside the tiled copy.
    from trapetum.additive import random_additive_tensor
    from trapetum.qlinear import AdditiveQLinear

    t = random_additive_tensor(40, 64, 2, seed=8)  # 40 rows: untiling must drop the row-block padding
    natural = t.codes.clone()
    q = AdditiveQLinear.from_additive(t)
    x = torch.randn(1, 64).half()
    y0 = _check_codes_held_once(q, x, natural)
    # one layout: the batch-1 plan (the table kernel in the simulator) picks the family of every call
    assert q._gemv.single_layout and q._gemv._stream_t is None
    q(torch.randn(3, 64).half())
    assert q._gemv._stream_t is None
    torch.testing.assert_close(q.dequantize(), t.dequantize())
    q.float()  # a move brings the natural buffer back
    assert torch.equal(q.codes, natural) and q._gemv is None
    torch.testing.assert_close(q(x), y0)
