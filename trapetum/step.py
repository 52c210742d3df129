"""Trapetum's own decode step for Llama-architecture models: five launches a layer.

The compiled transformers step (``decode`` path "compiled") spends ~0.65 ms of a 7B token outside
the projection GEMVs: two RMSNorm reductions, rotary and the cache writes, SDPA's input
preparation, SiLU x up and the residual adds, ~8 inductor launches of 1.2-2.8 us a layer beside
cuDNN's attention (NOTES "Fused projections"). Here a layer is

1. ``qkv = Wqkv rmsnorm(h)``: the input norm fused into the codebook GEMV's staging
   (:func:`trapetum.gemv.lut_kernel`, ``pre="rms"``);
2. ``a = attention(qkv)``: rotary, the cache write and attention in one launch
   (:mod:`trapetum.attention`);
3. ``h = h + Wo a`` (``post="add"``);
4. ``gu = Wgu rmsnorm(h)``;
5. ``h = h + Wd (silu(g) * u)`` (``pre="silu"``, ``post="add"``);

then ``logits = Whead rmsnorm(h)``, and one launch (:mod:`trapetum.greedy`) takes the argmax, records
the token, advances the position and gathers the token's embedding row into ``h`` for the next
step. Projections are fused first
(:func:`trapetum.fuse.fuse_projections`: q/k/v and gate/up as one weight each). A projection whose
kernel cannot fuse (fp16 nn.Linear, residual codebooks, a fixed tensor-core plan of a scalar codebook or
an additive plan whose table is not built on the tensor cores, a bias)
runs unfused with the model's own norm module and torch ops around it: every model of the
architecture decodes, the scalar-codebook ones with the fewest launches.

:class:`FusedStep` keeps :class:`trapetum.decode.DecodeStep`'s contract (static ``tok``, ``pos``,
``tokens``, ``i``; one call is one token, nothing read back), so the same CUDA-graph runner
replays it. It owns its KV cache; the prompt is fed through the same step, a token at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import DecodeAttention
from .fuse import FusedProjections, fuse_projections
from .gemv import programmatic_kernels


class UnsupportedModelError(ValueError):
    """The model is not a Llama-architecture causal LM the fused step can run."""


def _check(model) -> None:
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    need = ("embed_tokens", "layers", "norm", "rotary_emb")
    if cfg is None or inner is None or not all(hasattr(inner, n) for n in need) or not hasattr(model, "lm_head"):
        raise UnsupportedModelError("the fused step runs Llama-architecture causal LMs (model.model with embed_tokens, "
                                    f"layers, norm and rotary_emb, and model.lm_head); got {type(model).__name__}")
    why = []
    if getattr(cfg, "hidden_act", "silu") != "silu":
        why.append(f"hidden_act={cfg.hidden_act!r} (the step fuses SiLU)")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        why.append("projection biases")
    if getattr(cfg, "pretraining_tp", 1) != 1:
        why.append(f"pretraining_tp={cfg.pretraining_tp}")
    if why:
        raise UnsupportedModelError("the fused step does not support " + ", ".join(why))
    if inner.norm.weight.dtype != torch.float16:
        raise UnsupportedModelError(f"the fused step runs float16 models (model.half()); the norms are {inner.norm.weight.dtype}")


def _parts(mod: nn.Module, names: tuple[str, ...], parent: nn.Module) -> list[nn.Module]:
    """The linear layer(s) computing ``names`` of ``parent``, in output order."""
    return [mod.linear] if isinstance(mod, FusedProjections) else [getattr(parent, n) for n in names]


class FusedStep:
    """One greedy token of ``model`` (see the module docstring) from static buffers.

    ``max_len``: prompt plus generated tokens the cache holds; ``n``: tokens to record;
    ``keep_logits``: also record every step's logits (the graph-vs-eager check).
    :attr:`fused_launches` / :attr:`unfused_projections` say how much of the model took the fused kernels;
    :attr:`rotation_launches`: input rotations launched before rotated layers' GEMVs (:mod:`trapetum.hadamard`).
    """

    def __init__(self, model, max_len: int, n: int, keep_logits: bool = False, programmatic: bool = True):
        _check(model)
        fuse_projections(model)
        inner, cfg = model.model, model.config
        dev = inner.norm.weight.device
        H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        self.model, self.device = model, dev
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.i = torch.zeros(1, dtype=torch.long, device=dev)
        f16 = dict(dtype=torch.float16, device=dev)
        hidden = cfg.hidden_size
        self.h = torch.zeros(1, hidden, **f16)
        self.qkv = torch.zeros(1, (H + 2 * Hkv) * D, **f16)
        self.a = torch.zeros(1, H * D, **f16)
        self.gu = torch.zeros(1, 2 * cfg.intermediate_size, **f16)
        self.out = torch.zeros(1, model.lm_head.out_features, **f16)
        self.logits = torch.zeros(n, self.out.shape[1], **f16) if keep_logits else None
        rot = inner.rotary_emb  # the model's own frequencies and scaling (any rope type transformers applies statically)
        scale = getattr(inner.layers[0].self_attn, "scaling", D ** -0.5)
        self.attention = DecodeAttention(len(inner.layers), H, Hkv, D, max_len, rot.inv_freq, self.pos, dev, scale,
                                         rope_scaling=getattr(rot, "attention_scaling", 1.0))
        self.fused_launches, self.unfused_projections, self.rotation_launches = 0, [], 0
        self.plans: dict[str, str] = {}  # "in x out pre/post" -> the fused GEMV's launch plan
        self.embed = self._embed(inner.embed_tokens)
        self.ops = []
        # Programmatic launch (sm_90; trapetum.gemv.programmatic) for a launch whose stream predecessor
        # is always one of the step's kernels: not the first (the prefill's torch embedding precedes
        # it), nor one after a torch op (an unfused projection may end in a copy).
        self.programmatic = programmatic and programmatic_kernels()
        self._after_kernel = False
        for li, layer in enumerate(inner.layers):
            att, mlp = layer.self_attn, layer.mlp
            self._project(f"layers.{li}.qkv", _parts(getattr(att, "qkv_proj", None), ("q_proj", "k_proj", "v_proj"), att),
                          self.h, self.qkv, norm=layer.input_layernorm)
            self.ops.append(self.attention.bind(li, self.qkv, self.a, after_kernel=self._after_kernel))
            self._after_kernel = self.programmatic
            self._project(f"layers.{li}.o_proj", [att.o_proj], self.a, self.h, add=True)
            self._project(f"layers.{li}.gate_up", _parts(getattr(mlp, "gate_up_proj", None), ("gate_proj", "up_proj"), mlp),
                          self.h, self.gu, norm=layer.post_attention_layernorm)
            self._project(f"layers.{li}.down_proj", [mlp.down_proj], self.gu, self.h, silu=True, add=True)
        self._project("lm_head", [model.lm_head], self.h, self.out, norm=inner.norm)
        emb = inner.embed_tokens
        # The greedy launch gathers the next token's row itself from a plain fp16 embedding of the
        # LM head's vocabulary; any other embedding (a QEmbedding) runs after it as a torch op.
        fused_embed = (type(emb) is nn.Embedding and emb.weight.dtype == torch.float16 and emb.weight.is_contiguous()
                       and emb.weight.shape == (self.out.shape[1], hidden) and hidden % 2 == 0)
        from .greedy import Greedy

        self.greedy = Greedy(self.out, self.tokens, self.tok, self.pos, self.i,
                             emb.weight.detach() if fused_embed else None, self.h if fused_embed else None,
                             after_kernel=self._after_kernel and not keep_logits)  # keep_logits: a copy between
        self.finish = [self.greedy] if fused_embed else [self.greedy, self.embed]

    # -- building the launch list -----------------------------------------------------------------
    def _embed(self, emb):
        h, tok = self.h, self.tok

        def op():
            h.copy_(emb(tok).view(1, -1))
        return op

    def _project(self, name, linears, x, out, norm=None, silu=False, add=False):
        """Append the launches of ``out (+)= W pre(x)`` for the linears whose rows stack into ``out``."""
        from .additive import AdditiveGemv
        from .gemv import LutGemv
        from .qlinear import QLinear

        r0 = 0
        slices = []
        for lin in linears:
            slices.append(out[:, r0:r0 + lin.out_features])
            r0 += lin.out_features
        if r0 != out.shape[1]:
            raise UnsupportedModelError(f"{name}: the projections give {r0} outputs, the step expects {out.shape[1]}")
        kernels = []
        rot = getattr(linears[0], "rotation", None)  # rotated layers (QLinear.rotation) fuse only under one rotation
        for lin in linears:
            ok = (isinstance(lin, QLinear) and lin.bias is None and lin.mode == "fast" and lin.rotation == rot
                  and (lin.codes.is_cuda or lin.simulate))
            g = lin.gemv() if ok else None
            kernels.append(g if isinstance(g, (LutGemv, AdditiveGemv)) and g.fusable(1) else None)
        if all(k is not None for k in kernels):
            pre, post = "rms" if norm is not None else "silu" if silu else "", "add" if add else ""
            eps = getattr(norm, "variance_epsilon", 1e-6)
            if rot is not None:
                # The rotation's launch takes the pre-operation (it holds the whole row anyway) and writes
                # U pre(x); the GEMVs read that with no prologue of their own: one launch more, no torch op.
                xr = torch.empty(1, linears[0].in_features, dtype=torch.float16, device=x.device)
                self.ops.append(linears[0].rotator().launcher(x, xr, pre=pre, norm_weight=None if norm is None else norm.weight,
                                                              eps=eps, after_kernel=self._after_kernel))
                self.rotation_launches += 1
                self._after_kernel = self.programmatic
                x, pre, norm = xr, "", None
            for g, o in zip(kernels, slices):
                self.ops.append(g.bind(x, o, pre=pre, post=post, norm_weight=None if norm is None else norm.weight,
                                       eps=eps, res=o if add else None,
                                       after_kernel=self._after_kernel))
                self.fused_launches += 1
                self._after_kernel = self.programmatic
                self.plans[f"{g.n_in}x{g.n_out} {pre or '-'}/{post or '-'}"] = g.fused_plan(1, pre, post).label()
            return
        self.unfused_projections.append(name)
        self._after_kernel = False
        n_in = linears[0].in_features
        xin = torch.empty(1, n_in, dtype=torch.float16, device=x.device)

        def op():
            if norm is not None:
                xin.copy_(norm(x))
            elif silu:
                torch.mul(F.silu(x[:, :n_in]), x[:, n_in:], out=xin)
            else:
                xin.copy_(x)
            for lin, o in zip(linears, slices):
                if add:
                    o.add_(lin(xin))
                else:
                    o.copy_(lin(xin))
        self.ops.append(op)

    # -- running ----------------------------------------------------------------------------------
    def forward(self) -> torch.Tensor:
        """Run the launches for the token in ``tok`` at position ``pos``; returns the logits buffer."""
        self.embed()
        return self._layers()

    def _layers(self) -> torch.Tensor:
        for op in self.ops:
            op()
        return self.out

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed the prompt (1, P) a token at a time; leaves ``tok`` = its greedy next token at
        ``pos`` = P, recorded as ``tokens[0]``. Returns the last prompt position's logits (1, vocab)."""
        ids = input_ids.view(-1).to(self.device)
        for p in range(ids.numel()):
            self.tok.copy_(ids[p].view(1, 1))
            self.pos.fill_(p)
            self.forward()
        self.i.zero_()
        self._emit(self.out)
        return self.out.clone()

    @torch.no_grad()
    def __call__(self) -> None:
        # ``h`` already holds ``tok``'s embedding: the previous step's finish (or the prefill's) put it there.
        self._emit(self._layers())

    def _emit(self, logits: torch.Tensor) -> None:
        # The greedy token of ``logits`` becomes tokens[i] and the next input (its embedding in h);
        # position and index advance.
        if self.logits is not None:
            self.logits.index_copy_(0, self.i, logits)
        for op in self.finish:
            op()


# -- the kernels' correctness sweep (run on the device before any timing of this step) ---------------
FUSIONS = (("rms", ""), ("", "add"), ("silu", "add"))  # qkv / gate_up, o_proj, down_proj


def kernel_checks(shapes=((4096, 4096), (4096, 12288), (11008, 4096)), attention_cases=((32, 32, 128), (64, 8, 128)),
                  positions=(0, 5, 127, 128, 300, 530), device="cuda", seed=0, plans=(None, {"ksplit": 2}),
                  vocabs=(32000, 50257), additive_plans=(None, {"cps": 4, "build": "mma", "table": "fp16"},
                                                          {"kernel": "stream", "ksplit": 1, "warps": 16, "slots": 2},
                                                          {"kernel": "stream", "ksplit": 2, "warps": 8, "slots": 3})) -> list[dict]:
    """Every fused GEMV operation at ``shapes`` (in, out), for the 4-bit scalar codebook at ``plans``
    and the 2-bit additive one at ``additive_plans`` (kind "gemv" / "additive"), and the attention
    kernel for (heads, KV heads, head_dim) at ``positions``, against float64 references on fresh
    random inputs, outputs poisoned with NaN first; the greedy launch at ``vocabs`` against
    torch.argmax (a tie across threads included) and its embedding row. One record each: kind,
    shape, plan or position, max_rel_err (0 or 1 for the greedy launch's exact results), finite."""
    from . import additive
    from . import attention as attn
    from . import gemv
    from .codebook import random_codebook_tensor
    from .gemv import max_rel_err
    from .greedy import Greedy

    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    recs = []
    for n_in, n_out in shapes:
        weights = [("gemv", random_codebook_tensor(n_out, n_in, 16, seed=seed + n_in + n_out).to(dev), gemv.LutGemv, gemv.reference, plans),
                   ("additive", additive.random_additive_tensor(n_out, n_in, 2, seed=seed + n_in + n_out).to(dev),
                    additive.AdditiveGemv, additive.reference, additive_plans)]
        for kind, t, Gemv, ref, kind_plans in weights:
            for plan in kind_plans:
                lg = Gemv(t, device=dev if dev.type == "cuda" else None, plan=plan)
                if not lg.fusable(1):
                    recs.append({"kind": kind, "in_features": n_in, "out_features": n_out, "plan": str(plan), "fusable": False})
                    continue
                # additive also with |g x| past fp16's range, which LlamaRMSNorm survives by normalising first
                # (the chunk kernel stages g x un-normalised: such a chunk must be staged scaled down)
                cases = [(pre, post, False) for pre, post in FUSIONS] + ([("rms", "", True)] if kind == "additive" else [])
                for pre, post, wide in cases:
                    x = (torch.randn(1, 2 * n_in if pre == "silu" else n_in, generator=g) * 2).half()
                    w = torch.rand(n_in, generator=g) + 0.5
                    if wide:
                        x[0, n_in // 3], w[n_in // 3] = 60000.0, 1.5
                    x, w = x.to(dev), w.half().to(dev)
                    res = torch.randn(1, n_out, generator=g).half().to(dev)
                    y = torch.full((1, n_out), float("nan"), dtype=torch.float16, device=dev)
                    lg.bind(x, y, pre=pre, post=post, norm_weight=w if pre == "rms" else None, eps=1e-5, res=res if post else None)()
                    err = max_rel_err(y, ref(x, t, pre, post, w, res, 1e-5))
                    recs.append({"kind": kind, "in_features": n_in, "out_features": n_out,
                                 "plan": str(plan or lg.fused_plan(1, pre, post)), "pre": pre, "post": post, "max_rel_err": err,
                                 "finite": bool(torch.isfinite(y).all()), "inputs": "g x past fp16" if wide else "normal"})
    for H, Hkv, D in attention_cases:
        T = max(positions) + 1
        inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D)
        pos = torch.zeros(1, dtype=torch.long, device=dev)
        att = attn.DecodeAttention(1, H, Hkv, D, T, inv, pos, dev)
        for p in positions:
            att.k_cache.copy_(torch.randn(att.k_cache.shape, generator=g).half())
            att.v_cache.copy_(torch.randn(att.v_cache.shape, generator=g).half())
            kb, vb = att.k_cache[0].clone(), att.v_cache[0].clone()
            qkv = torch.randn(1, (H + 2 * Hkv) * D, generator=g).half().to(dev)
            out = torch.full((1, H * D), float("nan"), dtype=torch.float16, device=dev)
            pos.fill_(p)
            att.bind(0, qkv, out)()
            err = max_rel_err(out.view(-1), attn.reference(qkv, kb, vb, inv, p, H, Hkv))
            recs.append({"kind": "attention", "heads": H, "kv_heads": Hkv, "head_dim": D, "position": p,
                         "max_rel_err": err, "finite": bool(torch.isfinite(out).all()),
                         "counters_reset": bool((att.counters == 0).all())})
    for V in vocabs:
        hidden = 4096
        logits = torch.randn(1, V, generator=g).half().to(dev)
        top = logits.max()
        logits[0, V - 3] = top  # ties: the first index wins, as in torch
        logits[0, V // 3 + 1] = top
        emb = torch.randn(V, hidden, generator=g).half().to(dev)
        h = torch.full((1, hidden), float("nan"), dtype=torch.float16, device=dev)
        tokens = torch.full((4,), -1, dtype=torch.long, device=dev)
        tok = torch.full((1, 1), -1, dtype=torch.long, device=dev)
        pos, i = torch.tensor([9], device=dev), torch.tensor([2], device=dev)
        Greedy(logits, tokens, tok, pos, i, emb, h)()
        want = int(logits.argmax())
        ok = (tokens.tolist() == [-1, -1, want, -1] and tok.item() == want and pos.item() == 10 and i.item() == 3
              and torch.equal(h[0], emb[want]))
        recs.append({"kind": "greedy", "vocab": V, "token": int(tokens[2]), "want": want,
                     "max_rel_err": 0.0 if ok else 1.0, "finite": bool(torch.isfinite(h).all())})
    return recs
