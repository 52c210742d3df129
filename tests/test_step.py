"""Trapetum's fused decode step on a tiny random Llama, kernels in the CUDA simulator, against
transformers' eager path on the same quantized model."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from trapetum import gemv
from trapetum.decode import FakeGraphRunner, check_equivalence, generate
from trapetum.qlinear import qlinears, quantize_model
from trapetum.step import FusedStep, UnsupportedModelError, kernel_checks

from test_qlinear import tiny_llama

pytestmark = pytest.mark.skipif(not gemv.SIM, reason="written for the CUDA simulator")
N = 8


def quantized(seed, **kw):
    m = tiny_llama(seed=seed, **kw)
    quantize_model(m, K=16, iters=3, progress=False)
    m.half()
    for q in qlinears(m).values():
        q.simulate = True  # the kernels run in the simulator on CPU tensors
    return m


@pytest.fixture(scope="module")
def model():
    return quantized(5)


PROMPT = torch.tensor([[3, 17, 42, 8, 61]])


def test_fused_step_matches_the_eager_path(model):
    fake = FakeGraphRunner()
    r = check_equivalence(model, PROMPT, n=N, runner=fake, path="fused-step")
    assert fake.captures == 1 and fake.replays == N - 2
    assert r["first_mismatch"] is None, r
    assert r["max_rel_logit_diff"] < 1e-2, r


def test_fused_step_fuses_every_codebook_projection(model):
    step = FusedStep(model, max_len=16, n=4)
    # per layer: qkv (one fused weight), o, gate_up, down; the fp16 lm_head runs unfused
    assert step.fused_launches == 2 * 4 and step.unfused_projections == ["lm_head"]
    assert len(step.ops) == 2 * 5 + 1
    # the finish gathers the next token's row from the fp16 embedding itself: no torch op after it
    assert step.finish == [step.greedy]
    # each fused shape and operation names the plan it launches (recorded by the bench)
    assert sorted(k.split(" ")[1] for k in step.plans) == ["-/add", "rms/-", "rms/-", "silu/add"], step.plans
    assert all("warps" in v and "K-split" in v for v in step.plans.values())
    # the step bound of trapetum.decode.kernel_bound times each shape with the operations launched here
    from trapetum.decode import STEP_OPS, projection_shapes

    ops = {f"{a}x{b} {STEP_OPS[n][0] or '-'}/{STEP_OPS[n][1] or '-'}" for n, (a, b) in projection_shapes(model.config, True).items()}
    assert ops == set(step.plans), (ops, step.plans)


def test_fused_step_with_the_dual_kernel_matches_the_eager_path():
    # Every projection held to the dual tensor-core kernel: its fused norm (staged in fp16 as
    # transformers rounds it), SiLU x up and residual add, K-split 2 (an odd row-block count at 96 rows).
    from trapetum.fuse import fuse_projections

    m = quantized(6)
    fuse_projections(m)  # q/k/v and gate/up stacked first, so the plans below reach the weights the step launches
    for q in qlinears(m).values():
        g = q.gemv()
        g.fixed_plan = {"kernel": "dual", "warps": 4, "ksplit": 2}
        g._plans.clear()
        g._fused_plans.clear()
    step = FusedStep(m, max_len=16, n=4)
    assert step.fused_launches == 2 * 4 and all(v.startswith("dual:") for v in step.plans.values()), step.plans
    r = check_equivalence(m, PROMPT, n=4, runner=FakeGraphRunner(), path="fused-step")  # (each simulated step is slow)
    assert r["first_mismatch"] is None, r
    assert r["max_rel_logit_diff"] < 1e-2, r


def test_fp16_model_runs_unfused_and_agrees():
    m = tiny_llama(seed=6).half()
    r = check_equivalence(m, PROMPT, n=4, runner=FakeGraphRunner(), path="fused-step")
    assert r["first_mismatch"] is None and r["max_rel_logit_diff"] < 1e-2, r


def test_unsupported_models_are_refused():
    with pytest.raises(UnsupportedModelError, match="Llama-architecture"):
        FusedStep(nn.Linear(4, 4), max_len=8, n=2)
    with pytest.raises(UnsupportedModelError, match="biases"):
        FusedStep(tiny_llama(bias=True).half(), max_len=8, n=2)
    with pytest.raises(UnsupportedModelError, match="float16"):
        FusedStep(tiny_llama(), max_len=8, n=2)


def test_the_graphed_fused_step_needs_a_gpu(model):
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        generate(model, PROMPT, 4, path="fused-step", energy=False)


def test_kernel_checks_pass_on_small_shapes():
    recs = kernel_checks(
        shapes=((64, 96),), attention_cases=((4, 2, 16),), positions=(0, 20), device="cpu", plans=({"ksplit": 2},),
        vocabs=(300,), additive_plans=({"warps": 2, "build": "mma", "table": "fp16"}, {"kernel": "stream", "warps": 4, "ksplit": 1, "slots": 2}))
    assert [r["kind"] for r in recs] == ["gemv"] * 3 + ["additive"] * 8 + ["attention"] * 2 + ["greedy"]
    assert sum("stream" in r.get("plan", "") for r in recs) == 4  # the streaming kernel with each fused operation, rms twice
    assert sum(r.get("inputs") == "g x past fp16" for r in recs) == 2  # an rms call with |g x| past fp16, each additive plan
    assert all(r["finite"] and r["max_rel_err"] < 2e-3 for r in recs), recs


def test_an_additive_model_fuses_and_matches_the_eager_path():
    # 2-bit additive projections take the fused operations too (their tables built on the tensor
    # cores): every projection but the fp16 LM head runs fused, and the step agrees with eager.
    from trapetum import decode

    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=96)
    m = decode.random_llama("llama-2-7b", "A2", device="cpu", progress=False, fuse=True, **tiny)
    for q in qlinears(m).values():
        q.simulate = True
    step = FusedStep(m, max_len=16, n=4)
    assert step.fused_launches == 2 * 4 and step.unfused_projections == ["lm_head"]
    assert all(v.startswith("additive:") for v in step.plans.values()), step.plans
    r = check_equivalence(m, PROMPT, n=4, runner=FakeGraphRunner(), path="fused-step")
    assert r["first_mismatch"] is None and r["max_rel_logit_diff"] < 1e-2, r


def test_programmatic_launch_only_follows_the_steps_own_kernels(monkeypatch):
    # Where kernels can be launched programmatically (sm_90), a launch may start while the one before
    # it runs, so it must follow one of the step's kernels: never the first launch (the prefill's torch
    # embedding precedes it) nor one after a torch op (an unfused projection may end in a copy).
    from trapetum import decode, step as step_mod
    from trapetum.additive import AdditiveGemv
    from trapetum.attention import DecodeAttention
    from trapetum.gemv import LutGemv

    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=96)
    seen = []
    for cls in (AdditiveGemv, LutGemv, DecodeAttention):
        orig = cls.bind

        def bind(self, *a, _orig=orig, _name=cls.__name__, after_kernel=False, **kw):
            seen.append((_name, after_kernel))
            return _orig(self, *a, after_kernel=after_kernel, **kw)
        monkeypatch.setattr(cls, "bind", bind)
    monkeypatch.setattr(step_mod, "programmatic_kernels", lambda: True)
    for K, head_K, greedy_after in (("A2", None, False), ("A2", 16, True), (16, 16, True)):
        m = decode.random_llama("llama-2-7b", K, device="cpu", progress=False, fuse=True, head_K=head_K, **tiny)
        for q in qlinears(m).values():
            q.simulate = True
        seen.clear()
        st = step_mod.FusedStep(m, max_len=16, n=4)
        # every GEMV is told whether a kernel precedes it; LutGemv.bind then launches its dual plans
        # programmatically and its lut plans serially (test_gemv_sim)
        gemv_ = "LutGemv" if K == 16 else "AdditiveGemv"
        layer = [(gemv_, True), ("DecodeAttention", True), (gemv_, True), (gemv_, True), (gemv_, True)]
        head = [("LutGemv", True)] if head_K else []  # an fp16 head is an unfused torch op
        assert seen == [(gemv_, False)] + layer[1:] + layer + head, seen
        assert st.greedy.after_kernel is greedy_after
        assert FusedStep(m, max_len=16, n=4, keep_logits=True).greedy.after_kernel is False  # a logits copy precedes it
        assert FusedStep(m, max_len=16, n=4, programmatic=False).greedy.after_kernel is False
    # in the simulator nothing is launched programmatically, whatever the step asks
    monkeypatch.undo()
    assert not gemv.programmatic(True).on and not FusedStep(m, max_len=16, n=4).programmatic
