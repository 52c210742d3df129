"""End-to-end fine-tuning of the stored continuous parameters (trapetum.finetune), on a tiny random Llama.

What it must do: lower the KL to the unquantized model on the calibration tokens, leave every
code and the bits per weight as they were, store fp16-representable parameters, and refuse
schemes with nothing to train and bad option values. Runs in seconds on two cores.
"""
from __future__ import annotations

import pytest
import torch

from trapetum import finetune as F
from trapetum import pipelines as P

from test_accuracy import TEXT, ByteTokenizer, correlated_inputs, tiny_llama


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def calib_ids(n=8, seq_len=64):
    return P.calibration_ids(ByteTokenizer(), "Some calibration text that is not the evaluation text. " * 40, n_samples=n, seq_len=seq_len)


FORM_SPECS = {  # one small-option spec per scheme, for the checks that run every registered scheme
    "rtn": "rtn:group_size=32", "kmeans": "kmeans:iters=5", "kmeans-act": "kmeans-act:iters=5",
    "kmeans-act-scale": "kmeans-act-scale:iters=5,n_grid=3", "kmeans-awq": "kmeans-awq:iters=5,n_grid=3",
    "kmeans-hadamard": "kmeans-hadamard:iters=5", "awq": "awq:group_size=32,n_grid=3",
    "awq-lsq": "awq-lsq:group_size=32,n_grid=3", "awq-lsq-refit": "awq-lsq-refit:group_size=32,n_grid=3",
    "gptq": "gptq:group_size=32", "awq-gptq": "awq-gptq:group_size=32,n_grid=3", "hqq-gptq": "hqq-gptq:group_size=32",
    "gptq-kmeans": "gptq-kmeans", "gptq-kmeans-hadamard": "gptq-kmeans-hadamard", "additive": "additive:iters=1,beam=2",
    "additive-hadamard": "additive-hadamard:iters=1,beam=2",
    "hqq": "hqq:group_size=32", "residual": "residual:iters=2",
}


def test_every_scheme_declares_whether_it_returns_a_form_and_the_form_decodes_to_its_weight():
    assert set(FORM_SPECS) == set(P.SCHEMES)
    X, H = correlated_inputs(n=64, tokens=512)
    W = torch.randn(32, 64) * 0.02
    for name, spec in FORM_SPECS.items():
        _, opts = P.parse_spec(spec)
        q = P.get_scheme(name, **opts)[2](W, H)
        assert (q.form is not None) == P.SCHEMES[name].form, name
        if q.form is not None:
            assert torch.allclose(q.form.W_hat(), q.W_hat, rtol=1e-5, atol=1e-7), name
            assert not q.form.codes.dtype.is_floating_point, name


def quantize_and_capture(spec, calib, monkeypatch):
    """quantize() with the spec's fine-tuning, keeping each form's codes and parameters as they were before training."""
    seen = {}
    real = F.finetune

    def spy(model, teacher, forms, calib, **kw):
        seen["forms"] = forms
        seen["codes"] = {n: f.codes.clone() for n, f in forms.items()}
        seen["params"] = {n: {k: v.clone() for k, v in f.params.items()} for n, f in forms.items()}
        return real(model, teacher, forms, calib, **kw)

    monkeypatch.setattr(F, "finetune", spy)
    model = tiny_llama()
    name, opts = P.parse_spec(spec)
    rep = P.quantize(model, name, calib, calibration="test text", progress=False, **opts)
    return model, rep, seen


@pytest.mark.parametrize("spec, gain", [
    ("rtn:group_size=32,bits=3,ft_epochs=3,ft_lr=3e-3,ft_batch=2", 0.8),
    ("awq-lsq-refit:group_size=32,n_grid=3,bits=3,ft_epochs=3,ft_lr=3e-3,ft_batch=2", 0.8),
    ("kmeans:bits=3,iters=5,ft_epochs=3,ft_lr=3e-3,ft_batch=2", 0.8),
    # on matrices this small the additive codebooks (2 x 256 vectors) nearly fit the weight: KL ~1e-5 to start
    ("additive:iters=1,beam=2,ft_epochs=3,ft_lr=3e-3,ft_batch=2", 0.95),
])
def test_finetuning_lowers_the_kl_and_keeps_codes_bits_and_fp16(spec, gain, monkeypatch):
    calib = calib_ids()
    model, rep, seen = quantize_and_capture(spec, calib, monkeypatch)
    ft = rep.finetune
    assert ft["kl_after"] < gain * ft["kl_before"], ft
    assert ft["steps"] == 3 * 4 and len(ft["loss_curve"]) == 3 and rep.quantize_seconds >= ft["seconds"] > 0
    name, opts = P.parse_spec(spec)
    plain = P.quantize(tiny_llama(), name, calib, progress=False,
                       **{k: v for k, v in opts.items() if k not in P.FINETUNE_OPTIONS})
    assert rep.bits_per_weight == plain.bits_per_weight and plain.finetune is None
    moved = 0
    for n, m in P.decoder_linears(model).items():
        f = seen["forms"][n]
        assert torch.equal(f.codes, seen["codes"][n])  # codes untouched
        for k, v in f.params.items():
            assert torch.equal(v, v.half().float()), (n, k)  # what the format stores: fp16
            moved += int(not torch.equal(v, seen["params"][n][k]))
        assert torch.equal(m.weight.data, f.W_hat().to(m.weight.dtype))  # the model runs the stored parameters
        assert not torch.nn.utils.parametrize.is_parametrized(m)
    assert moved > 0


def test_finetune_leaves_grad_flags_and_training_mode_as_it_found_them():
    model, teacher, calib = tiny_llama(), tiny_llama(), calib_ids(n=2, seq_len=32)
    name, opts = "rtn", {"group_size": 32}
    qfn = P.get_scheme(name, **opts)[2]
    forms = {}
    for n, m in P.decoder_linears(model).items():
        q = qfn(m.weight.data.float())
        m.weight.data.copy_(q.W_hat)
        forms[n] = q.form
    weights = {n: m.weight for n, m in P.decoder_linears(model).items()}
    F.finetune(model, teacher, forms, calib, epochs=1, lr=1e-3, batch=2, progress=False)
    assert all(p.requires_grad for p in model.parameters()) and not model.training
    assert all(m.weight is weights[n] for n, m in P.decoder_linears(model).items())  # the same Parameter objects
    with pytest.raises(ValueError, match="no form"):
        F.finetune(model, teacher, {}, calib, progress=False)
    with pytest.raises(ValueError, match="epochs"):
        F.finetune(model, teacher, forms, calib, epochs=0, progress=False)


def test_norms_train_only_when_asked_and_are_stored_as_fp16():
    calib = calib_ids()
    for norms in (False, True):
        model, teacher = tiny_llama(), tiny_llama()
        before = {n: p.detach().clone() for n, p in P.norm_weights(model).items()}
        assert len(before) == 2 * len(P.decoder_layers(model)) + 1  # two a layer and the final norm
        qfn = P.get_scheme("rtn", group_size=32, bits=3)[2]
        forms = {}
        for n, m in P.decoder_linears(model).items():
            q = qfn(m.weight.data.float())
            m.weight.data.copy_(q.W_hat)
            forms[n] = q.form
        rep = F.finetune(model, teacher, forms, calib, epochs=2, lr=3e-3, batch=2, norms=norms, progress=False)
        after = P.norm_weights(model)
        moved = [n for n, p in after.items() if not torch.equal(p, before[n])]
        assert rep.norms is norms and bool(moved) is norms and rep.kl_after < rep.kl_before
        n_norm = sum(p.numel() for p in after.values())
        n_form = sum(v.numel() for f in forms.values() for v in f.params.values())
        assert rep.trained_parameters == n_form + (n_norm if norms else 0)
        assert all(torch.equal(p, p.half().to(p.dtype)) for p in after.values()) or not norms
        assert all(p.requires_grad for p in model.parameters())


def test_kl_is_zero_for_the_teacher_itself_and_positive_otherwise():
    a = torch.randn(2, 5, 11)
    assert float(F.kl_to_teacher(a, a)) == pytest.approx(0, abs=1e-6)
    assert float(F.kl_to_teacher(a + torch.randn_like(a), a)) > 0


@pytest.mark.parametrize("spec, match", [
    ("gptq:group_size=32,ft_epochs=1", "exposes no form"),
    ("hqq:ft_epochs=1", "exposes no form"),
    ("rtn:ft_lr=1e-3", "without ft_epochs"),
    ("rtn:ft_epochs=0", "ft_epochs >= 1"),
    ("rtn:ft_epochs=1,ft_lr=2", "ft_lr < 1"),
    ("rtn:ft_epochs=1,ft_lr=-1e-3", "0 < ft_lr"),
    ("rtn:ft_epochs=1,ft_batch=0", "ft_batch >= 1"),
    ("rtn:ft_epochs=two", "bad fine-tuning option value"),
    ("rtn:ft_epochs=1,ft_lr=fast", "bad fine-tuning option value"),
    ("rtn:ft_epochs=1,ft_steps=3", "no option"),
    ("rtn:ft_epochs=1,ft_norms=yes", "ft_norms must be true or false"),
])
def test_bad_finetuning_options_fail_before_the_model_loads(spec, match, monkeypatch):
    from trapetum import ppl

    monkeypatch.setattr(ppl, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    with pytest.raises(P.SchemeError, match=match):
        P.compare("smollm2-135m", [spec])


def test_quantize_needs_calibration_tokens_to_finetune():
    with pytest.raises(P.SchemeError, match="pass calib"):
        P.quantize(tiny_llama(), "rtn", None, progress=False, group_size=32, ft_epochs=1)


def test_compare_records_the_finetuning_under_the_specs_label(tmp_path, monkeypatch):
    from trapetum import ppl

    f = tmp_path / "wiki.raw"
    f.write_text(TEXT)
    monkeypatch.setattr(ppl, "load_model", lambda name, device=None: (tiny_llama(), ByteTokenizer()))
    spec = "rtn:group_size=32,bits=3,ft_epochs=2,ft_lr=3e-3,ft_batch=2"
    recs = P.compare("tiny", ["rtn:group_size=32,bits=3", spec], text_file=f, token_budget=256, ctx=128,
                     calibration_source="generated", n_calib=4, calib_len=32, progress=False)
    plain, tuned = recs[1], recs[2]
    assert tuned["label"] == spec and tuned["options"] == plain["options"] and plain["finetune"] is None
    assert tuned["bits_per_weight"] == plain["bits_per_weight"]
    assert tuned["finetune"]["ft_epochs"] == 2 and tuned["finetune"]["kl_after"] < tuned["finetune"]["kl_before"]
    assert tuned["calibration"] == P.GENERATED_DESC and tuned["calibration_tokens"] == 128
    assert tuned["quantize_seconds"] >= tuned["finetune"]["seconds"]


def test_compare_restores_trained_norms_before_the_next_scheme(tmp_path, monkeypatch):
    from trapetum import ppl

    f = tmp_path / "wiki.raw"
    f.write_text(TEXT)
    models = []

    def load(name, device=None):
        models.append(tiny_llama())
        return models[-1], ByteTokenizer()

    monkeypatch.setattr(ppl, "load_model", load)
    plain = "rtn:group_size=32,bits=3"
    recs = P.compare("tiny", [plain, plain + ",ft_epochs=2,ft_lr=3e-2,ft_batch=2,ft_norms=true", plain], text_file=f,
                     token_budget=256, ctx=128, calibration_source="generated", n_calib=4, calib_len=32, progress=False)
    assert recs[2]["finetune"]["norms"] is True
    assert recs[3]["ppl"] == recs[1]["ppl"]  # the norms the fine-tuning moved were put back
    assert all(torch.equal(p, q) for p, q in zip(P.norm_weights(models[0]).values(), P.norm_weights(tiny_llama()).values()))


def test_finetune_table_reads_a_runs_records():
    import pandas as pd

    run = pd.DataFrame([
        {"scheme": "reference", "label": "reference", "ppl": 20.0, "bits_per_weight": None, "quantize_seconds": 0.0, "finetune": None},
        {"scheme": "awq-lsq-refit", "label": "awq-lsq-refit:group_size=96", "ppl": 22.0, "bits_per_weight": 4.356,
         "quantize_seconds": 300.0, "finetune": None},
        {"scheme": "awq-lsq-refit", "label": "awq-lsq-refit:group_size=96,ft_epochs=2", "ppl": 21.5, "bits_per_weight": 4.356,
         "quantize_seconds": 900.0, "finetune": {"seconds": 600.0, "epochs": 2, "steps": 32, "kl_before": 0.1, "kl_after": 0.05}},
        {"scheme": "hqq", "label": "hqq:group_size=96", "ppl": None, "bits_per_weight": None, "quantize_seconds": None, "finetune": None},
    ])
    t = P.finetune_table(run)
    assert t.scheme.tolist() == ["awq-lsq-refit:group_size=96", "awq-lsq-refit:group_size=96,ft_epochs=2"]  # unmeasured rows left out
    assert t["vs reference (%)"].tolist() == pytest.approx([10.0, 7.5]) and t["within +8%"].tolist() == ["no", "yes"]
    assert pd.isna(t.loc[0, "KL after (nats/token)"]) and t.loc[1, "KL after (nats/token)"] == 0.05
    assert t.loc[1, "of which fine-tuning (s)"] == 600.0
    assert t["norms trained"].tolist() == ["", "no"]  # a run from before ft_norms: linears only
    run.at[2, "finetune"] = {**run.at[2, "finetune"], "ft_norms": True}
    assert P.finetune_table(run)["norms trained"].tolist() == ["", "yes"]


def test_recode_moves_only_the_chosen_groups_and_never_away_from_the_target():
    from trapetum import additive as A

    t = A.random_additive_tensor(16, 64, 2, seed=1)
    other = A.random_additive_tensor(16, 64, 2, seed=2)
    target = A._decode(other.codes, t.codebooks.float(), t.scales.float())  # reachable with t's codebooks
    kw = dict(codebooks=t.codebooks.float(), scales=t.scales.float(), beam=4)
    assert torch.equal(A.recode(t.codes, t.dequantize(torch.float32), **kw), t.codes)  # at the target already
    groups = torch.zeros(16, 8, dtype=torch.bool)
    groups[::3, 1::2] = True
    new = A.recode(t.codes, target, groups, **kw)
    assert torch.equal(new[~groups], t.codes[~groups]) and not torch.equal(new[groups], t.codes[groups])
    err = lambda c: (A._decode(c, t.codebooks.float(), t.scales.float()) - target).reshape(16, 8, 8).pow(2).sum(-1)
    assert bool((err(new) <= err(t.codes) + 1e-6).all()) and float(err(new)[groups].sum()) < float(err(t.codes)[groups].sum())
    with pytest.raises(ValueError, match="target must be"):
        A.recode(t.codes, target[:, :8], **kw)
    with pytest.raises(ValueError, match="groups must be"):
        A.recode(t.codes, target, groups[:, :4], **kw)


def test_newton_target_picks_the_most_promising_group_and_its_codes_lower_the_local_model():
    torch.manual_seed(0)
    W = torch.randn(32, 64)
    q = P.additive(W, None, M=2, iters=1, beam=2)
    m = F._FormWeight(q.form)
    X = torch.randn(256, 64)
    X[:, 20] *= 30  # a channel with large activations: a change there moves the outputs most
    H = X.T @ X / X.shape[0]
    g = torch.zeros(32, 64)
    g[3, 8:16] = 5.0  # one group with most of the gradient...
    g[5, 16:24] = 5.0  # ...and one as large, on the loud channel: its Newton step is small, so it promises less
    g[7, :] = 1e-3
    m.grad = g
    step, groups, Hd = m.newton_target(H, torch.tensor(1.0), frac=1 / (32 * 8))
    assert groups.sum() == 1 and bool(groups[3, 1])
    old = m.codes.clone()
    with torch.no_grad():
        W0 = m.decode(old, **m.values)
        for scale in (1.0, 0.25):
            new = m.propose(step, groups, Hd, scale)
            assert torch.equal(new[~groups], old[~groups])
            E = m.decode(new, **m.values) - W0
            model = float((g * E).sum() + 0.5 / scale * ((E @ Hd) * E).sum())  # the quadratic model the search minimizes
            assert model <= 1e-6
    assert not torch.equal(m.propose(step, groups, Hd, 1.0), old)  # a full step is far enough to change a code here


def test_code_rounds_keep_only_rounds_that_lower_the_kl_and_the_forms_hold_the_codes_the_model_runs(monkeypatch):
    calib = calib_ids()
    spec = "additive:iters=1,beam=2,ft_epochs=3,ft_lr=3e-3,ft_batch=2,ft_code_rounds=2,ft_code_frac=0.2,ft_code_lr=1.0"
    model, rep, seen = quantize_and_capture(spec, calib, monkeypatch)
    ft = rep.finetune
    assert ft["code_rounds"] == 2 and len(ft["code_changes"]) == 2 and len(ft["code_kl"]) == 2
    for frac, (before, after, scale) in zip(ft["code_changes"], ft["code_kl"]):
        assert 0 <= frac <= 0.2 and (frac == 0 or (after < before and scale in (1.0, 0.25)))
    for n, m in P.decoder_linears(model).items():
        f = seen["forms"][n]
        assert torch.equal(m.weight.data, f.W_hat().to(m.weight.dtype))
    assert ft["kl_after"] < ft["kl_before"]


@pytest.mark.parametrize("spec, match", [
    ("rtn:ft_epochs=1,ft_code_rounds=1", "cannot update its codes"),
    ("additive:ft_epochs=1,ft_code_rounds=1,ft_code_frac=0", "ft_code_frac <= 1"),
    ("additive:ft_epochs=1,ft_code_rounds=-1", "ft_code_rounds >= 0"),
    ("additive:ft_epochs=1,ft_code_rounds=1,ft_code_lr=0", "ft_code_lr"),
])
def test_bad_code_round_options_are_refused(spec, match):
    name, opts = P.parse_spec(spec)
    with pytest.raises(P.SchemeError, match=match):
        P.finetune_options(name, opts)
