"""End-to-end fine-tuning of a quantized model's continuous parameters, codes fixed, by distillation.

A layer-wise quantizer chooses every matrix's integer codes and fits its continuous parameters
(steps and mins of affine grids, AWQ input scales, codebook entries) to that one layer's output
error on the calibration inputs. Fitting those harder lowered the layer-wise error and not the
perplexity (NOTES.md, session 13): the layer objective is not the model's. This step keeps the
codes and trains only the continuous parameters that the format stores, so that the quantized
model's next-token distribution matches the unquantized model's: the KL divergence from the
teacher's (the reference model's) to the student's, on the calibration tokens. It is the
global fine-tuning of AQLM and PV-tuning, EfficientQAT's E2E-QP (step sizes only, codes frozen)
and LLM-QAT's data-free distillation (the calibration text can be the model's own samples,
:func:`trapetum.pipelines.generated_calibration_ids`).

Each decoder nn.Linear's weight is computed from its :class:`~trapetum.pipelines.Form` during
training (``torch.nn.utils.parametrize``). With ``norms=True`` the RMSNorm weights (each decoder
layer's two and the final one) train too, as in AQLM's and PV-tuning's global fine-tuning: they are
not quantized and are a few thousand values, so the bytes stored do not change. Embeddings and the
head stay frozen. At the end every trained parameter is rounded to fp16, as the format stores it, and the
weights are left as the decoded fp16 parameters, so the storage and the bits per weight do not
change. Entry points: :func:`finetune`; :func:`trapetum.pipelines.quantize` runs it when a scheme
spec carries ``ft_epochs`` (see :data:`trapetum.pipelines.FINETUNE_OPTIONS`).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize
from tqdm.auto import tqdm


@dataclass
class FinetuneReport:
    epochs: int
    steps: int
    lr: float  # relative: each tensor's Adam step size is lr x its initial mean |value| (see finetune)
    batch: int
    loss_curve: list = field(default_factory=list)  # mean training KL (nats/token) of each epoch, while it trained
    kl_before: float = math.nan  # mean KL to the teacher on the first eval_samples calibration samples, before
    kl_after: float = math.nan  # the same, after, with the parameters rounded to fp16 as stored
    eval_samples: int = 0
    norms: bool = False  # the RMSNorm weights trained as well
    code_rounds: int = 0  # discrete steps (codes moved toward a Newton step) between phases of training
    code_changes: list = field(default_factory=list)  # per round: the fraction of all codes that changed, 0 where reverted
    code_tries: list = field(default_factory=list)  # per round: [step size, fraction of codes it changed, its KL] for each proposal
    code_kl: list = field(default_factory=list)  # per round: [KL before, the best proposal's KL, its step size or None] on the eval samples
    trained_parameters: int = 0  # continuous values trained (codes are not parameters)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class _FormWeight(nn.Module):
    """The parametrization: a linear's weight = its form's decode of the fixed codes and the trainable parameters."""

    def __init__(self, form, shared: dict | None = None):
        super().__init__()
        self.register_buffer("codes", form.codes, persistent=False)
        shared = {} if shared is None else shared
        for v in form.params.values():  # a tensor several forms hold (a joint group's codebooks) is one parameter;
            if id(v) not in shared:  # v is kept beside it, so its id is not reused while the map lives
                shared[id(v)] = (v, nn.Parameter(v.detach().float().clone()))
        self.values = nn.ParameterDict({k: shared[id(v)][1] for k, v in form.params.items()})
        self.decode = form.decode

        self.recode = form.recode
        self.grad = None  # when a tensor: each backward adds the loss's gradient with respect to the weight

    def forward(self, original: torch.Tensor) -> torch.Tensor:  # the stored weight is ignored: the form is the weight
        w = self.decode(self.codes, **self.values)
        if self.grad is not None and w.requires_grad:
            w.register_hook(self._add_grad)
        return w.to(original.dtype)

    def _add_grad(self, g: torch.Tensor) -> None:  # returns None: the gradient flows on unchanged
        self.grad.add_(g)

    @torch.no_grad()
    def newton_target(self, H: torch.Tensor, curvature: torch.Tensor, frac: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the weight's Newton step, the groups it may recode, the metric) for the discrete step.

        The loss near the current weight W is modelled per layer as <G, E> + (j/2) tr(E H E^T):
        G the gradient (self.grad), H = E[x x^T] of the layer's inputs, j the mean curvature of the
        loss per output (``curvature``: the mean squared per-token output gradient of labels
        sampled from the model, a true Fisher). Its minimum over each 8-weight group, the other
        groups held, is E = -G_g H_gg^-1 / j; the fraction ``frac`` of groups whose step promises
        the most, G_g H_gg^-1 G_g^T, are chosen. The metric for the codes' search is H, so that a code change is measured as the
        change it makes to the layer's outputs (a step along the raw gradient moved weights that
        multiply the largest activations and sent the KL from 0.6 to 13-80 in the screens)."""
        n_out, G, _ = self.codes.shape
        g = self.grad.reshape(n_out, G, -1)
        d = g.shape[-1]
        H = H + 1e-2 * H.diagonal().mean().clamp_min(1e-12) * torch.eye(H.shape[0], device=H.device)
        blocks = torch.stack([H[k * d:(k + 1) * d, k * d:(k + 1) * d] for k in range(G)])
        step = torch.einsum("rgd,gde->rge", g, torch.linalg.inv(blocks))
        score = (g * step).sum(-1)
        k = max(1, round(frac * score.numel()))
        groups = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
        groups[score.reshape(-1).topk(k).indices] = True
        return -(step / curvature.clamp_min(1e-30)).reshape(n_out, G * d), groups.reshape(n_out, G), H

    @torch.no_grad()
    def propose(self, step: torch.Tensor, groups: torch.Tensor, H: torch.Tensor, scale: float) -> torch.Tensor:
        """Codes for the target W + scale x step, searched in the metric H on the chosen groups only."""
        W = self.decode(self.codes, **self.values)
        return self.recode(self.codes, W + scale * step, groups, metric=H, **self.values).to(self.codes.dtype)


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student), nats: sum_v p_t (log p_t - log p_s).

    The forward KL (teacher first) is the distillation loss of LLM-QAT and AQLM's fine-tuning: it
    weights each token by the teacher's probability, so the student is pulled toward everything
    the reference model considers likely, as perplexity on real text will ask of it."""
    t = torch.log_softmax(teacher_logits.float(), -1)
    s = torch.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False).logits


@torch.no_grad()
def _mean_kl(model, teacher, calib: torch.Tensor, batch: int) -> float:
    total = 0.0
    for b in range(0, calib.shape[0], batch):
        x = calib[b:b + batch]
        total += float(kl_to_teacher(_logits(model, x), _logits(teacher, x))) * x.shape[0]
    return total / calib.shape[0]


def _add_square(acc: torch.Tensor, g: torch.Tensor, n_b: int) -> None:
    # The batch loss is a mean over its n_b tokens: a token's own output gradient is n_b x g. None: g flows on.
    acc.add_(g.detach().float().pow(2).sum() * n_b * n_b)


def _code_round(model, teacher, calib, batch, pairs, frac, lr, grad_batches, eval_x, gen, report) -> None:
    """One discrete step (see finetune): gradients, input moments and curvature of each recodable layer on
    ``grad_batches`` batches; Newton targets; codes proposed at step sizes lr and lr / 4; the proposal
    with the lower KL on the eval samples is kept if it is below the KL before, else the codes stay."""
    dev = calib.device
    stats = {}
    fisher = False  # which passes run: the KL's (its gradient, the inputs' moments) or the sampled labels' (curvature)

    def hook(m):
        def f(mod, inp, out):
            st = stats[m]
            x = inp[0].detach().reshape(-1, inp[0].shape[-1]).float()
            if not fisher:
                st["H"].addmm_(x.T, x)
                st["n"] += x.shape[0]
            elif out.requires_grad:
                out.register_hook(lambda g, n_b=x.shape[0]: _add_square(st["j"], g, n_b))
        return f

    handles = []
    for lin, m in pairs:
        stats[m] = dict(H=torch.zeros(lin.in_features, lin.in_features, device=dev), n=0, j=torch.zeros((), device=dev))
        m.grad = torch.zeros(lin.out_features, lin.in_features, device=dev)
        handles.append(lin.register_forward_hook(hook(m)))
    pick = torch.randperm(calib.shape[0], generator=gen)[:grad_batches * batch].to(dev)
    batches = [calib[pick[b:b + batch]] for b in range(0, pick.numel(), batch)]
    try:
        with torch.enable_grad():
            for x in batches:
                with torch.no_grad():
                    t_logits = _logits(teacher, x)
                kl_to_teacher(_logits(model, x), t_logits).backward()
            # The curvature: the true Fisher, from labels sampled from the model itself (its mean
            # squared output gradient is the Gauss-Newton curvature of the log-loss). The KL's own
            # squared gradients would be an empirical Fisher, which vanishes as the student nears
            # the teacher and sends the Newton step to infinity. These passes add to no gradient.
            grads = [m.grad for _, m in pairs]
            for _, m in pairs:
                m.grad = None
            fisher = True
            for x in batches:
                logits = _logits(model, x).float()
                y = torch.distributions.Categorical(logits=logits.detach()).sample()
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    finally:
        for h in handles:
            h.remove()
    for (_, m), g in zip(pairs, grads):
        m.grad = g / len(batches)
    plans = []
    for lin, m in pairs:
        st = stats[m]
        plans.append(m.newton_target(st["H"] / st["n"], st["j"] / (st["n"] * lin.out_features), frac))  # n: tokens of both passes alike
        m.grad = None
    before = _mean_kl(model, teacher, eval_x, batch)
    old = [m.codes for _, m in pairs]
    best = (before, None, None)
    tried = []
    for scale in (lr, lr / 4):
        new = [m.propose(*plan, scale) for (_, m), plan in zip(pairs, plans)]
        for (_, m), c in zip(pairs, new):
            m.codes = c
        kl = _mean_kl(model, teacher, eval_x, batch)
        tried.append([scale, sum(int((c != o).sum()) for c, o in zip(new, old)) / sum(o.numel() for o in old), kl])
        if kl < best[0]:
            best = (kl, scale, new)
        for (_, m), c in zip(pairs, old):
            m.codes = c
    changed = 0
    if best[2] is not None:
        for (_, m), c, o in zip(pairs, best[2], old):
            m.codes = c
            changed += int((c != o).sum())
    report.code_changes.append(changed / sum(c.numel() for c in old))
    report.code_kl.append([before, best[0], best[1]])
    report.code_tries.append(tried)


def finetune(model, teacher, forms: dict, calib: torch.Tensor, *, epochs: int = 1, lr: float = 1e-3, batch: int = 4,
             norms: bool = False, code_rounds: int = 0, code_frac: float = 0.02, code_lr: float = 0.25,
             grad_batches: int = 8, eval_samples: int = 8, seed: int = 0, progress: bool = True) -> FinetuneReport:
    """Train the continuous parameters of ``forms`` (decoder linear name -> Form, codes fixed) so that
    ``model``'s next-token distribution matches ``teacher``'s on ``calib`` (LongTensor [n, seq_len]).

    model: the quantized model (its decoder linears named as in ``forms``); teacher: the unquantized
    model, frozen (only its logits are used). A params tensor that several forms hold (the same
    object: one codebook set for a joint group) trains as one parameter, so the group keeps one set. Adam for ``epochs`` passes over the calibration
    samples in seeded random order, ``batch`` samples a step, cosine decay of the step size to 0.
    lr is relative: a tensor's step size is lr x its initial mean |value|, because the parameters
    differ by orders of magnitude (a 4-bit step ~1e-3, an AWQ input scale ~1) and one absolute lr
    would be too large for one kind and a no-op for another. At the end each parameter is rounded
    to fp16, the forms' params are replaced by the rounded values (codes untouched), and each
    linear's weight is the decoded weight again, as a plain parameter. kl_before/kl_after: the mean
    KL on the first ``eval_samples`` calibration samples, before training and after the rounding.
    norms: train the norm weights as well (:func:`trapetum.pipelines.norm_weights`), rounded to fp16 at the end too.

    code_rounds > 0 adds PV-tuning's discrete step for forms that can recode: the training steps are
    split into code_rounds + 1 equal phases, and between two phases each layer's gradient, input
    second moment and output curvature are measured on ``grad_batches`` batches, and its
    ``code_frac`` of groups with the most promising Newton step may change codes toward code_lr x
    that step (and, tried too, a quarter of it) (:meth:`_FormWeight.newton_target`). A round is
    kept only if it lowers the KL on the eval samples, so a step that is too large costs time, not
    accuracy. The forms' codes are then the new codes; the format and its bits per weight are unchanged.
    Measured so far (NOTES.md, session 27): on SmolLM2-135M at 2 bits every proposal raised the KL
    and was undone, so this option has not yet improved a real model; it helped only the tiny test one.
    """
    from .pipelines import decoder_linears, norm_weights

    if epochs < 1 or batch < 1 or not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"need epochs >= 1, batch >= 1 and a finite lr > 0, got {epochs}, {batch}, {lr}")
    if code_rounds < 0 or not (0 < code_frac <= 1) or not (code_lr > 0 and math.isfinite(code_lr)) or grad_batches < 1:
        raise ValueError(f"need code_rounds >= 0, 0 < code_frac <= 1, a finite code_lr > 0 and grad_batches >= 1, got "
                         f"{code_rounds}, {code_frac}, {code_lr}, {grad_batches}")
    if code_rounds and not any(forms[n].recode for n in forms):
        raise ValueError("code_rounds > 0 needs forms that can recode (the additive codebooks); these cannot")
    if calib is None or calib.dim() != 2 or calib.numel() == 0:
        raise ValueError("fine-tuning needs calibration tokens: a LongTensor [n_samples, seq_len]")
    linears = decoder_linears(model)
    missing = set(linears) - set(forms)
    if missing:
        raise ValueError(f"no form for {len(missing)} decoder linear(s), e.g. {sorted(missing)[0]}")
    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    calib = calib.to(dev)
    n_eval = min(eval_samples, calib.shape[0])
    was_training, teacher_training = model.training, teacher.training
    model.eval()  # no dropout either way; eval keeps the model's own settings as the perplexity pass uses them
    teacher.eval()
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    for p in teacher.parameters():
        p.requires_grad_(False)
    mods, shared = {}, {}
    try:
        for name, lin in linears.items():
            mods[name] = _FormWeight(forms[name], shared).to(dev)
            parametrize.register_parametrization(lin, "weight", mods[name], unsafe=True)
        trained = list({id(v): v for m in mods.values() for v in m.values.values()}.values())
        if norms:
            trained += [p.requires_grad_(True) for p in norm_weights(model).values()]
        report = FinetuneReport(epochs=epochs, steps=0, lr=lr, batch=batch, eval_samples=n_eval, norms=norms,
                                code_rounds=code_rounds, trained_parameters=sum(v.numel() for v in trained))
        if n_eval:
            report.kl_before = _mean_kl(model, teacher, calib[:n_eval], batch)
        groups = [{"params": [v], "lr": lr * float(v.detach().abs().mean().clamp_min(1e-12))} for v in trained]
        opt = torch.optim.Adam(groups)
        per_epoch = math.ceil(calib.shape[0] / batch)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 * (1 + math.cos(math.pi * k / (epochs * per_epoch))))
        gen = torch.Generator().manual_seed(seed)
        total_steps = epochs * per_epoch
        code_at = {round(total_steps * r / (code_rounds + 1)) for r in range(1, code_rounds + 1)}
        recodable = [(linears[n], m) for n, m in mods.items() if m.recode is not None]
        eval_x = calib[:max(n_eval, 1)]
        bar = tqdm(total=total_steps, desc="fine-tuning (KL to the reference)", disable=not progress, leave=False)
        for _ in range(epochs):
            order = torch.randperm(calib.shape[0], generator=gen)
            total = 0.0
            for b in range(0, calib.shape[0], batch):
                if report.steps in code_at:
                    _code_round(model, teacher, calib, batch, recodable, code_frac, code_lr, grad_batches, eval_x, gen, report)
                    opt.zero_grad(set_to_none=True)
                x = calib[order[b:b + batch].to(dev)]
                with torch.no_grad():
                    t_logits = _logits(teacher, x)
                with torch.enable_grad():  # quantize() runs under no_grad
                    loss = kl_to_teacher(_logits(model, x), t_logits)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                opt.step()
                sched.step()
                total += float(loss.detach()) * x.shape[0]
                report.steps += 1
                bar.update(1)
                bar.set_postfix(kl=f"{float(loss.detach()):.4f}")
            report.loss_curve.append(total / calib.shape[0])
        bar.close()
        with torch.no_grad():  # the format stores fp16: round, so the PPL measured is the stored model's
            for v in trained:
                v.copy_(v.half().to(v.dtype))
        if n_eval:
            report.kl_after = _mean_kl(model, teacher, calib[:n_eval], batch)
    finally:
        for name, lin in linears.items():
            if parametrize.is_parametrized(lin, "weight"):
                parametrize.remove_parametrizations(lin, "weight", leave_parametrized=True)
        for p in frozen:
            p.requires_grad_(True)
        model.train(was_training)
        teacher.train(teacher_training)
    for name, m in mods.items():
        forms[name].params = {k: v.detach().clone() for k, v in m.values.items()}
        forms[name].codes = m.codes
    report.seconds = time.perf_counter() - t0
    return report
