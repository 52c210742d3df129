"""Fused q/k/v and gate/up projections (trapetum.fuse) on tiny random Llamas, CPU."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trapetum import decode
from trapetum.decode import FakeGraphRunner, generate
from trapetum.fuse import FusedProjections, ProjectionPart, fuse_projections, is_fused, stack
from trapetum.qlinear import AdditiveQLinear, QLinear, qlinears, quantize_model, save_quantized

from test_qlinear import tiny_llama

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96)


def _logits(m, ids):
    with torch.no_grad():
        return m(input_ids=ids).logits


@pytest.mark.parametrize("kind", ["fp32", "K16"])
def test_a_fused_model_computes_what_the_unfused_one_did(kind):
    m = tiny_llama(seed=3, bias=True)
    if kind == "K16":
        quantize_model(m, K=16, iters=2, progress=False)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    before = _logits(m, ids)
    n_params = sum(p.numel() for p in m.state_dict().values())
    report = fuse_projections(m)
    assert report == {f"model.layers.{i}.{p}": "fused" for i in range(2) for p in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
    attn = m.model.layers[0].self_attn
    assert isinstance(attn.q_proj, ProjectionPart) and isinstance(attn.qkv_proj, FusedProjections)
    assert attn.qkv_proj.out_features == 64 + 2 * 32 and attn.k_proj.out_features == 32
    # one copy of every weight: the parts are not submodules
    assert sum(p.numel() for p in m.state_dict().values()) == n_params
    assert not any(".q_proj." in k for k in m.state_dict())
    torch.testing.assert_close(_logits(m, ids), before, rtol=1e-5, atol=1e-5)
    assert fuse_projections(m) == report  # fusing twice is a no-op
    if kind == "K16":
        assert all(k.endswith(("qkv_proj.linear", "gate_up_proj.linear", "o_proj", "down_proj")) for k in qlinears(m))


def test_parts_recompute_for_another_input_and_drop_the_activation():
    lin = [nn.Linear(8, n) for n in (8, 4, 4)]
    group = FusedProjections(stack(lin), (8, 4, 4), ("q", "k", "v"))
    q, k, v = (ProjectionPart(group, i) for i in range(3))
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    assert torch.allclose(q(x), lin[0](x))
    # k is handed another tensor than q was: recompute, never the stale output
    assert torch.allclose(k(y), lin[1](y), atol=1e-6)
    assert torch.allclose(v(y), lin[2](y), atol=1e-6)
    assert group._x is None and group._parts is None
    assert torch.allclose(v(x), lin[2](x), atol=1e-6)  # called alone, out of order


def test_what_does_not_fuse_is_left_alone_and_says_why():
    m = tiny_llama(seed=4)
    mlp = m.model.layers[0].mlp
    mlp.up_proj = nn.Linear(64, 128, bias=True)
    report = fuse_projections(m)
    assert report["model.layers.0.mlp.gate_up_proj"] == "some have a bias and some do not"
    assert report["model.layers.0.self_attn.qkv_proj"] == "fused"
    assert isinstance(mlp.gate_proj, nn.Linear)
    with pytest.raises(ValueError, match="cannot fuse"):
        stack([mlp.gate_proj, mlp.up_proj])


def test_additive_layers_fuse_only_with_shared_codebooks():
    from trapetum.additive import random_additive_tensor

    a, b = (AdditiveQLinear.from_additive(random_additive_tensor(32, 64, 2, device="cpu", generator=torch.Generator().manual_seed(s)))
            for s in (0, 1))
    with pytest.raises(ValueError, match="different codebooks"):
        stack([a, b])
    b.codebooks = a.codebooks
    f = stack([a, b])
    x = torch.randn(3, 64, dtype=torch.float16)
    ref = torch.cat([a.dequantize(torch.float32), b.dequantize(torch.float32)])
    torch.testing.assert_close(f.dequantize(torch.float32), ref)
    assert isinstance(f, AdditiveQLinear) and f.out_features == 64
    torch.testing.assert_close(f(x.float()), x.float() @ ref.t(), rtol=1e-4, atol=1e-4)


def test_residual_layers_fuse_only_with_shared_codebooks_and_norms():
    from trapetum.qlinear import ResidualQLinear
    from trapetum.residual import random_residual_tensor

    a, b = (ResidualQLinear.from_residual(random_residual_tensor(n, 256, generator=torch.Generator().manual_seed(s), with_norm=True))
            for n, s in ((32, 0), (16, 1)))
    with pytest.raises(ValueError, match="different codebooks or norms"):
        stack([a, b])
    b.main, b.res = a.main, a.res
    with pytest.raises(ValueError, match="different codebooks or norms"):  # the norms still differ
        stack([a, b])
    b.norm_scale, b.norm_bias = a.norm_scale, a.norm_bias
    f = stack([a, b])
    assert isinstance(f, ResidualQLinear) and f.out_features == 48 and f.norm
    ref = torch.cat([a.dequantize(torch.float32), b.dequantize(torch.float32)])
    torch.testing.assert_close(f.dequantize(torch.float32), ref)
    c = ResidualQLinear.from_residual(random_residual_tensor(16, 256, 8192, 512, generator=torch.Generator().manual_seed(2)))
    assert "different codebook sizes" in str(pytest.raises(ValueError, stack, [a, c]).value)


def test_random_residual_groups_share_codebooks_when_fused():
    tiny = dict(TINY, hidden_size=256, intermediate_size=512)
    m = decode.random_llama("llama-2-7b", "R4096+256", device="cpu", progress=False, fuse=True, **tiny)
    layer = m.model.layers[0]
    assert is_fused(m) and type(layer.self_attn.qkv_proj.linear).__name__ == "ResidualQLinear"
    assert layer.mlp.gate_up_proj.linear.out_features == 2 * 512


def test_fused_decode_through_the_replayed_and_compiled_steps(monkeypatch):
    m = decode.random_llama("llama-2-7b", 16, device="cpu", progress=False, fuse=True, **TINY).float()
    assert is_fused(m)
    prompt = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    eager = generate(m, prompt, 10, path="eager", energy=False).tokens
    assert generate(m, prompt, 10, path="graphed", energy=False, runner=FakeGraphRunner()).tokens == eager
    monkeypatch.setenv("TRAPETUM_COMPILE_BACKEND", "eager")  # dynamo traces the parts' hand-over
    assert generate(m, prompt, 10, path="compiled", energy=False, runner=FakeGraphRunner()).tokens == eager
    # the unfused model of the same seed has the same weights, row for row
    u = decode.random_llama("llama-2-7b", 16, device="cpu", progress=False, **TINY).float()
    assert generate(u, prompt, 10, path="eager", energy=False).tokens == eager


def test_random_additive_groups_share_codebooks_when_fused():
    m = decode.random_llama("llama-2-7b", "A2", device="cpu", progress=False, fuse=True, **TINY)
    layer = m.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj.linear, AdditiveQLinear)
    assert isinstance(layer.mlp.gate_up_proj.linear, AdditiveQLinear)
    assert isinstance(layer.self_attn.o_proj, AdditiveQLinear)


def test_a_fused_model_is_not_saved(tmp_path):
    m = tiny_llama(seed=5)
    quantize_model(m, K=16, iters=2, progress=False)
    fuse_projections(m)
    with pytest.raises(ValueError, match="save the model before fusing"):
        save_quantized(m, tmp_path / "q")


def test_decode_bench_compares_fused_rows_with_fused_fp16():
    tiny = dict(TINY, num_key_value_heads=4)
    recs = decode.decode_bench("llama-2-7b", Ks=(16,), paths=("graphed",), fp16_paths=("graphed",), gen_len=5, prompt_len=20,
                               energy=False, progress=False, device="cpu", fuses=(False, True), **tiny)
    assert [(r["scheme"], r["fused"]) for r in recs] == [("fp16", False), ("4-bit K=16", False), ("fp16", True), ("4-bit K=16", True)]
    assert recs[3]["fp16_tok_s"] == recs[2]["tok_s"] and recs[1]["fp16_tok_s"] == recs[0]["tok_s"]
    cfg = decode.llama_config("llama-2-70b")
    assert decode.projection_shapes(cfg, fused=True) == {"qkv_proj": (8192, 10240), "o_proj": (8192, 8192),
                                                        "gate_up_proj": (8192, 57344), "down_proj": (28672, 8192)}


def test_cli_generate_fuses_a_loaded_model(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    m = tiny_llama(seed=6)
    quantize_model(m, K=16, iters=2, progress=False)
    words = ["<unk>"] + [f"w{i}" for i in range(95)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    save_quantized(m, tmp_path / "m", tokenizer=PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>"))
    args = ["generate", str(tmp_path / "m"), "--prompt", "w1 w2 w3", "--max-new-tokens", "6", "--path", "eager", "--device", "cpu", "--no-energy"]
    assert decode.main(args) == 0
    plain = capsys.readouterr().out
    assert decode.main(args + ["--fuse"]) == 0
    fused = capsys.readouterr().out
    assert "not fused" not in fused
    assert plain.splitlines()[0] == fused.splitlines()[0]  # the same generated text
