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
    code_rounds: int = 0  # discrete steps (codes moved toward the gradient step) between phases of training
    code_changes: list = field(default_factory=list)  # per round: the fraction of all codes that changed, 0 where reverted
    code_kl: list = field(default_factory=list)  # per round: [KL before, KL after] on the eval samples (kept only if lower)
    trained_parameters: int = 0  # continuous values trained (codes are not parameters)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class _FormWeight(nn.Module):
    """The parametrization: a linear's weight = its form's decode of the fixed codes and the trainable parameters."""

    def __init__(self, form):
        super().__init__()
        self.register_buffer("codes", form.codes, persistent=False)
        self.values = nn.ParameterDict({k: nn.Parameter(v.detach().float().clone()) for k, v in form.params.items()})
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
    def code_step(self, frac: float, lr: float) -> tuple[int, int]:
        """PV-tuning's discrete step: the codes of the fraction ``frac`` of groups with the largest
        gradient are re-chosen toward a step from the decoded weight along -grad, and a group keeps
        its new codes only if they change the weight in a descent direction. Each group's step has
        the same length, lr x its row's RMS weight per element: the gradient is heavy-tailed, and a
        step proportional to it sends a few groups' targets far past every codebook entry (which
        the first GPU screen showed: KL 0.64 -> 13). (codes changed, codes)."""
        W = self.decode(self.codes, **self.values)
        n_out, G = self.codes.shape[:2]
        g = self.grad.reshape(n_out, G, -1)
        Wg = W.reshape(n_out, G, -1)
        unit = g / g.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        row_rms = Wg.pow(2).mean((1, 2), keepdim=True).sqrt()
        target = (Wg - lr * row_rms * g.shape[-1] ** 0.5 * unit).reshape(W.shape)
        score = g.pow(2).sum(-1)
        k = max(1, round(frac * score.numel()))
        groups = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
        groups[score.reshape(-1).topk(k).indices] = True
        new = self.recode(self.codes, target, groups.reshape(n_out, G), **self.values).to(self.codes.dtype)
        delta = (self.decode(new, **self.values) - W).reshape(n_out, G, -1)
        descent = (g * delta).sum(-1) < 0
        new = torch.where(descent[..., None], new, self.codes)
        changed = int((new != self.codes).sum())
        self.codes = new
        return changed, self.codes.numel()


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


def norm_weights(model) -> dict[str, nn.Parameter]:
    """The RMSNorm (or LayerNorm) weights of the decoder layers and the final norm, by name."""
    from .pipelines import decoder_layers

    decoder_layers(model)  # SchemeError for a model that is not a Llama-architecture decoder
    return {n: p for n, p in model.model.named_parameters()
            if n.endswith("norm.weight") and p.dim() == 1 and not n.startswith("embed")}


def _code_round(model, teacher, calib, batch, mods, frac, lr, grad_batches, eval_x, gen, report) -> None:
    """One discrete step (see finetune): gradients with respect to the weights, codes moved, kept if the KL fell."""
    dev = calib.device
    for m in mods:
        m.grad = torch.zeros_like(m.decode(m.codes, **m.values).detach())
    pick = torch.randperm(calib.shape[0], generator=gen)[:grad_batches * batch].to(dev)
    with torch.enable_grad():
        for b in range(0, pick.numel(), batch):
            x = calib[pick[b:b + batch]]
            with torch.no_grad():
                t_logits = _logits(teacher, x)
            kl_to_teacher(_logits(model, x), t_logits).backward()
    before = _mean_kl(model, teacher, eval_x, batch)
    old = [m.codes for m in mods]
    changed = total = 0
    for m in mods:
        c, n = m.code_step(frac, lr)
        changed, total = changed + c, total + n
        m.grad = None
    after = _mean_kl(model, teacher, eval_x, batch)
    if not after < before:
        for m, c in zip(mods, old):
            m.codes = c
        changed = 0
    report.code_changes.append(changed / max(total, 1))
    report.code_kl.append([before, after])


def finetune(model, teacher, forms: dict, calib: torch.Tensor, *, epochs: int = 1, lr: float = 1e-3, batch: int = 4,
             norms: bool = False, code_rounds: int = 0, code_frac: float = 0.02, code_lr: float = 0.1,
             grad_batches: int = 8, eval_samples: int = 8, seed: int = 0, progress: bool = True) -> FinetuneReport:
    """Train the continuous parameters of ``forms`` (decoder linear name -> Form, codes fixed) so that
    ``model``'s next-token distribution matches ``teacher``'s on ``calib`` (LongTensor [n, seq_len]).

    model: the quantized model (its decoder linears named as in ``forms``); teacher: the unquantized
    model, frozen (only its logits are used). Adam for ``epochs`` passes over the calibration
    samples in seeded random order, ``batch`` samples a step, cosine decay of the step size to 0.
    lr is relative: a tensor's step size is lr x its initial mean |value|, because the parameters
    differ by orders of magnitude (a 4-bit step ~1e-3, an AWQ input scale ~1) and one absolute lr
    would be too large for one kind and a no-op for another. At the end each parameter is rounded
    to fp16, the forms' params are replaced by the rounded values (codes untouched), and each
    linear's weight is the decoded weight again, as a plain parameter. kl_before/kl_after: the mean
    KL on the first ``eval_samples`` calibration samples, before training and after the rounding.
    norms: train the norm weights as well (:func:`norm_weights`), rounded to fp16 at the end too.

    code_rounds > 0 adds PV-tuning's discrete step for forms that can recode: the training steps are
    split into code_rounds + 1 equal phases, and between two phases the loss's gradient with respect
    to each weight is summed over ``grad_batches`` batches, and each layer's ``code_frac`` of groups
    with the largest gradient may change codes toward a step of relative size ``code_lr`` along it
    (:meth:`_FormWeight.code_step`). A round is kept only if it lowers the KL on the eval samples
    (it is reverted otherwise), so a step size that is too large costs time, not accuracy. The
    forms' codes are then the new codes; the format and its bits per weight are unchanged.
    """
    from .pipelines import decoder_linears

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
    mods = {}
    try:
        for name, lin in linears.items():
            mods[name] = _FormWeight(forms[name]).to(dev)
            parametrize.register_parametrization(lin, "weight", mods[name], unsafe=True)
        trained = [v for m in mods.values() for v in m.values.values()]
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
        recodable = [m for m in mods.values() if m.recode is not None]
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
