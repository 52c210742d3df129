"""Greedy decoding by seed 004's three integration paths and two faster ones, measured: tok/s, peak VRAM, J/token.

* ``naive``: the per-layer custom-op swap. A Python loop of model forwards with transformers'
  DynamicCache; every QLinear casts its input to fp32 and back (``QLinear.mode = "naive"``).
* ``eager`` (cast-free): the decode step the graph captures, run eagerly: StaticCache, fp16 end
  to end, no casts. Python still walks every layer and launches every kernel each token.
* ``graphed``: the same step captured once in a ``torch.cuda.CUDAGraph``; one replay is one
  token and Python does nothing per layer. The step keeps everything on the device: it reads the
  token and position from static tensors, writes the argmax into the output buffer and advances
  both, and StaticCache advances its own length tensor, so replays chain with no host work.
* ``compiled``: the graphed step through torch.compile (inductor fuses the norms, rotary and
  activations between the GEMVs).
* ``fused-step``: Trapetum's own step (:class:`trapetum.step.FusedStep`), graphed: the norms,
  SiLU and residual adds ride on the codebook GEMVs and attention is one kernel, five launches a
  layer; it keeps its own KV cache and feeds the prompt through the same step.

Eager and graphed run the *same* :class:`DecodeStep`: the only difference is who calls it
(:class:`EagerRunner` or :class:`CudaGraphRunner`), so the tokens must agree exactly. On CPU a
:class:`FakeGraphRunner` (capture records the step, replay calls it) exercises the same
static-buffer logic the graph relies on.

``python -m trapetum.decode generate MODEL ...`` generates and prints the metrics;
``python -m trapetum.decode bench ...`` runs :func:`decode_bench` (random weights, real
architectures) and writes ``<out>/<gpu>/decode.json``.
"""
from __future__ import annotations

import argparse
import inspect
import os
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from .qlinear import QLinear, qlinears, set_mode

PATHS = ("naive", "eager", "graphed", "compiled", "fused-step")
GRAPHED = ("graphed", "compiled", "fused-step")  # paths that replay one CUDA graph a token
# `decode check`'s default logit tolerance (of the largest logit) per path. "graphed" replays the eager
# step's own kernels, so its logits should agree to the last bit. "compiled" (inductor's fused norms)
# and "fused-step" (the norm and SiLU applied in fp32 as x is staged, never rounded to fp16 between
# them) round differently from eager, and the differences add up over the layers: at SmolLM2-135M's
# 30 layers ~0.5 % of the largest logit with all 32 greedy tokens equal (NOTES "Session 21").
CHECK_TOL = {"graphed": 1e-3, "compiled": 1e-2, "fused-step": 1e-2}


# -- the decode step ------------------------------------------------------------------------------
class DecodeStep:
    """One greedy token from static buffers, nothing read back to the host.

    ``tok`` (1, 1) and ``pos`` (1, 1) hold the last token and its position; ``tokens`` (n,) receives
    the generated ids, ``i`` (1,) is the write index. Every tensor is updated in place, so a graph
    captured over one call replays the next token.
    """

    def __init__(self, model, cache, first_token: torch.Tensor, prompt_len: int, n: int, first_logits: torch.Tensor | None = None):
        dev = first_token.device
        self.model, self.cache = model, cache
        self.tok = first_token.detach().view(1, 1).clone()
        self.pos = torch.full((1, 1), prompt_len, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.tokens[0] = first_token.view(-1)[0]
        self.i = torch.ones(1, dtype=torch.long, device=dev)
        # Optional (n, vocab) record of every step's logits, for the eager-vs-graphed check.
        self.logits = None
        if first_logits is not None:
            self.logits = first_logits.new_zeros(n, first_logits.shape[-1])
            self.logits[0] = first_logits.view(-1)
        # transformers versions whose forward still takes cache_position would otherwise derive it
        # from the cache's length with a host read, which a graph capture refuses: pass it statically.
        self.kw = {}
        if "cache_position" in inspect.signature(model.forward).parameters:
            self.kw["cache_position"] = self.pos.view(1)

    def __call__(self) -> None:
        logits = self.model(input_ids=self.tok, position_ids=self.pos, past_key_values=self.cache, use_cache=True, **self.kw).logits
        nxt = logits[:, -1].argmax(dim=-1)
        self.tokens.index_copy_(0, self.i, nxt)
        if self.logits is not None:
            self.logits.index_copy_(0, self.i, logits[:, -1])
        self.tok.copy_(nxt.view(1, 1))
        self.pos.add_(1)
        self.i.add_(1)


def compiled_forward(model, backend: str | None = None):
    """``model``'s forward through torch.compile, cached on the model (one compilation per model).

    ``backend``: torch.compile's (default inductor; TRAPETUM_COMPILE_BACKEND overrides it, which
    the CPU tests use to trace without generating code).
    """
    fwd = model.__dict__.get("_trapetum_compiled")
    if fwd is None:
        backend = backend or os.environ.get("TRAPETUM_COMPILE_BACKEND", "inductor")
        fwd = torch.compile(model, backend=backend, dynamic=False, fullgraph=False)
        model.__dict__["_trapetum_compiled"] = fwd  # not a submodule: state_dict must not see it twice
    return fwd


class EagerRunner:
    """Calls the step from Python every token (the cast-free eager path)."""

    def capture(self, step) -> None:
        self.step = step

    def replay(self) -> None:
        self.step()


class FakeGraphRunner(EagerRunner):
    """CPU stand-in for CUDAGraphRunner: records the step once and replays it, no Python change per token.

    Counts captures and replays so tests can check the loop does one replay a token.
    """

    def __init__(self):
        self.captures = self.replays = 0

    def capture(self, step) -> None:
        self.captures += 1
        super().capture(step)

    def replay(self) -> None:
        self.replays += 1
        super().replay()


class CudaGraphRunner:
    """Captures the step in one torch.cuda.CUDAGraph; ``replay()`` is one token.

    The step must have run eagerly once before capture (numba compiles and tunes its kernels,
    cuBLAS picks its algorithms, StaticCache allocates): the caller's first token does that.
    """

    def __init__(self, pool=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, step) -> None:
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            step()
        torch.cuda.synchronize()

    def replay(self) -> None:
        self.graph.replay()


def _side_stream_call(step, dev) -> None:
    """One eager call of ``step`` on a side stream, as torch requires before a CUDA-graph capture
    (kernels compiled and tuned, lazy allocations made off the capture stream)."""
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream(dev).wait_stream(s)


# -- timing ---------------------------------------------------------------------------------------
class Timer:
    """Seconds of a region: CUDA events on a GPU (device time, no host sync inside), perf_counter on CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self._a, self._b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._a.record()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._b.record()
            self._b.synchronize()
            self.seconds = self._a.elapsed_time(self._b) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0
        return False


@dataclass
class Generation:
    path: str
    tokens: list[int]  # generated ids (the prompt excluded)
    prompt_len: int
    gen_len: int
    decode_seconds: float  # tokens 2..n (the first comes from the prefill)
    prefill_seconds: float
    tok_s: float
    peak_vram_gb: float | None
    mean_w: float | None = None
    j_per_token: float | None = None
    energy_error: str | None = None
    extra: dict = field(default_factory=dict)
    logits: torch.Tensor | None = field(default=None, repr=False)  # (gen_len, vocab) float32 on CPU, with keep_logits

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("tokens")
        d.pop("logits")
        d.update(d.pop("extra"))
        return d


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def _meter(energy, device):
    """A started PowerMeter, or (None, why) when there is no reading to take."""
    if energy is False or torch.device(device).type != "cuda":
        return None, None if energy is False else "no GPU: no power reading"
    from .energy import NVMLUnavailable, PowerMeter

    try:
        m = PowerMeter(source=energy if callable(energy) else None)
    except NVMLUnavailable as e:
        return None, str(e)
    return m, None


@torch.inference_mode()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, path: str = "graphed", energy=True, runner=None,
             keep_logits: bool = False, programmatic: bool = True) -> Generation:
    """Greedy decode ``max_new_tokens`` tokens after ``input_ids`` (1, P) by one of PATHS.

    ``energy``: True (NVML on a GPU), False, or a callable returning watts. ``runner``: for the
    eager/graphed paths, override the step runner (tests pass a FakeGraphRunner on CPU).
    No early stop at EOS: every path generates exactly ``max_new_tokens`` tokens, the fixed
    window the metrics are defined over. ``keep_logits``: also return every step's logits
    (costs one (gen_len, vocab) buffer; leave it off when timing). ``programmatic``: the fused step's
    kernels may start while the one before runs (sm_90; :class:`trapetum.step.FusedStep`).
    """
    from transformers import DynamicCache, StaticCache

    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be a (1, prompt_len >= 1) tensor, got {getattr(input_ids, 'shape', input_ids)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    dev = _device_of(model)
    if path in GRAPHED and runner is None and dev.type != "cuda":
        raise RuntimeError("the graphed path captures a CUDA graph and needs the model on a CUDA GPU (use path='eager' on CPU)")
    input_ids = input_ids.to(dev)
    P, n = input_ids.shape[1], max_new_tokens
    set_mode(model, "naive" if path == "naive" else "fast")
    cuda = dev.type == "cuda"
    step = None
    if path == "fused-step":
        from .step import FusedStep

        # Built before the peak is reset: its buffers and cache stay allocated and count, while the
        # tuner's scratch (weight copies past the L2, once a shape) does not, as the other paths tune
        # in the kernel-bound timing before it (NOTES, session 20).
        step = FusedStep(model, P + n, n, keep_logits=keep_logits, programmatic=programmatic)  # its own cache; the prompt a token at a time
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)

    if path == "fused-step":
        with Timer(dev) as t_pre:
            step.prefill(input_ids)
    else:
        if path == "naive":
            cache = DynamicCache(config=model.config)
        else:
            cache = StaticCache(config=model.config, max_cache_len=P + n)
        with Timer(dev) as t_pre:
            logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            first = logits[:, -1].argmax(dim=-1)

    meter, why = _meter(energy, dev)
    all_logits = None
    if path == "naive":
        out = [first.view(1)]
        kept = [logits[:, -1]] if keep_logits else None
        tok = first.view(1, 1)
        if meter:
            meter.start()
        with Timer(dev) as t_dec:
            for k in range(1, n):
                pos = torch.tensor([[P + k - 1]], device=dev)
                logits = model(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True).logits
                tok = logits[:, -1].argmax(dim=-1, keepdim=True)
                out.append(tok.view(1))
                if kept is not None:
                    kept.append(logits[:, -1])
        tokens = torch.cat(out)
        if kept is not None:
            all_logits = torch.cat(kept)
    else:
        # "compiled": the step's forward through torch.compile (the fused kernel stays one opaque
        # custom op), which fuses the norms, rotary and activations between the GEMVs; then graphed.
        if step is None:
            fwd = compiled_forward(model) if path == "compiled" else model
            step = DecodeStep(fwd, cache, first, P, n, first_logits=logits[:, -1] if keep_logits else None)
        if n > 1:
            # The first decoded token runs eagerly: warm-up for the capture (kernels compiled and tuned).
            if cuda and path in GRAPHED:
                _side_stream_call(step, dev)
            else:
                step()
        if runner is None:
            runner = CudaGraphRunner() if path in GRAPHED else EagerRunner()
        if n > 2:
            runner.capture(step)
        if meter:
            meter.start()
        with Timer(dev) as t_dec:
            for _ in range(n - 2):
                runner.replay()
        tokens, all_logits = step.tokens, step.logits
    reading = None
    if meter:
        try:
            reading = meter.stop()
        except Exception as e:  # noqa: BLE001 - energy is reported as missing, not fatal to the run
            why = f"{type(e).__name__}: {e}"
    timed = n - 1 if path == "naive" else n - 2
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if cuda else None
    g = Generation(
        path=path, tokens=[int(v) for v in tokens.tolist()], prompt_len=P, gen_len=n,
        decode_seconds=t_dec.seconds, prefill_seconds=t_pre.seconds,
        tok_s=timed / t_dec.seconds if timed > 0 and t_dec.seconds > 0 else float("nan"),
        peak_vram_gb=peak, energy_error=why,
        extra={"timed_tokens": timed, **({"fused_plans": step.plans, "programmatic": step.programmatic} if path == "fused-step" else {})},
        logits=None if all_logits is None else all_logits.float().cpu(),
    )
    if reading is not None and timed > 0:
        # J/token = mean W x s/token over the decode window (seed 004).
        g.mean_w = reading.mean_w
        g.j_per_token = reading.mean_w * t_dec.seconds / timed
    return g


def check_equivalence(model, input_ids: torch.Tensor, n: int = 32, runner=None, reference: str = "eager",
                      path: str = "graphed") -> dict:
    """Greedy tokens and logits of a graphed ``path`` against another path of the same model.

    Returns the number of leading tokens that agree, the first mismatch (or None) and the
    largest logit difference over the steps both paths saw the same prefix (relative to the
    largest logit magnitude). ``runner``: a FakeGraphRunner on CPU.
    """
    a = generate(model, input_ids, n, path=reference, energy=False, keep_logits=True)
    b = generate(model, input_ids, n, path=path, energy=False, runner=runner, keep_logits=True)
    same = 0
    while same < n and a.tokens[same] == b.tokens[same]:
        same += 1
    # Logits are comparable up to and including the first step whose token differs.
    upto = min(n, same + 1)
    diff = (a.logits[:upto] - b.logits[:upto]).abs().max().item()
    scale = a.logits[:upto].abs().max().clamp_min(1e-30).item()
    return {"tokens": n, "reference": reference, "path": path, "matching_prefix": same, "first_mismatch": None if same == n else same,
            "max_abs_logit_diff": diff, "max_rel_logit_diff": diff / scale,
            "reference_tokens": a.tokens, "graphed_tokens": b.tokens}


# -- models ---------------------------------------------------------------------------------------
# Published Hugging Face configs (meta-llama/Llama-2-{7b,13b,70b}-hf).
LLAMA2 = {
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "llama-2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40, vocab_size=32000),
    "llama-2-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=32000),
}


def llama_config(arch: str, **overrides):
    from transformers import LlamaConfig

    if arch not in LLAMA2:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(LLAMA2)}")
    kw = dict(LLAMA2[arch], max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, attn_implementation="sdpa")
    kw.update(overrides)
    return LlamaConfig(**kw)


def _kind(K) -> str | None:
    """A scheme's format (:func:`trapetum.qlinear.parse_scheme`): "scalar", "additive", "residual"; None for fp16."""
    from .qlinear import parse_scheme

    return None if K is None else parse_scheme(K)[0]


def random_qlinear(in_features: int, out_features: int, K: int, device, generator=None) -> QLinear:
    """A QLinear with random codes and codebooks made on the device (speed does not depend on values)."""
    from .qlinear import parse_scheme

    kind, params = parse_scheme(K)
    if kind == "residual":  # "R<main>+<residual>"
        from .qlinear import ResidualQLinear
        from .residual import random_residual_tensor

        return ResidualQLinear.from_residual(random_residual_tensor(out_features, in_features, *params, device=device, generator=generator))
    if kind == "additive":  # "A2" / "A4": additive codebooks with M = 2 / 4
        from .additive import random_additive_tensor
        from .qlinear import AdditiveQLinear

        t = random_additive_tensor(out_features, in_features, params[0], device=device, generator=generator)
        return AdditiveQLinear.from_additive(t)
    from .codebook import random_codebook_tensor

    return QLinear.from_codebook(random_codebook_tensor(out_features, in_features, params[0], device=device, generator=generator))


@torch.no_grad()
def random_llama(arch: str, K: int | None, device="cuda", seed: int = 0, progress: bool = True, head_K: int | None = None,
                 fuse: bool = False, embed_K: int | None = None, rotate: bool | str = False, **overrides):
    """A Llama-2 architecture with random fp16 weights built directly on the device, layer by layer.

    ``K=None``: fp16 nn.Linear projections. Otherwise every decoder projection is a random
    QLinear and no fp16 copy of it ever exists, so 70B at 4 bits is built without the 138 GB of
    fp16 weights. Weights ~ N(0, 0.02) as Llama's init, norms 1. ``head_K``: the LM head a
    scalar codebook QLinear too (at 7B the fp16 head is 0.26 GB, 7 % of a 4-bit model).
    ``embed_K``: the token embedding a scalar codebook :class:`~trapetum.qlinear.QEmbedding`.
    ``fuse``: each layer's q/k/v and gate/up become one layer each (:mod:`trapetum.fuse`); additive
    and residual groups are then built with one shared codebook set (a group quantized jointly),
    since layers with separate codebooks do not fuse.
    ``rotate``: every decoder projection rotates its inputs (:attr:`~trapetum.qlinear.QLinear.rotation`, seed 0),
    as ``quantize_model(..., rotate=True)`` leaves them; the LM head does not. ``rotate="stream"``: down_proj only,
    as ``quantize_model(..., rotate="stream")`` leaves a model (its residual stream rotated: random weights
    rotated are random weights, so only where the launches are matters for speed).
    """
    from .hadamard import rotates_at_run_time
    from .fuse import GROUPS, fuse_projections

    from tqdm.auto import tqdm
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    config = llama_config(arch, **overrides)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            m = model.model
            if embed_K is None:
                m.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
                m.embed_tokens.weight.normal_(0, 0.02, generator=gen)
            else:
                from .codebook import random_codebook_tensor
                from .qlinear import QEmbedding

                m.embed_tokens = QEmbedding.from_codebook(random_codebook_tensor(config.vocab_size, config.hidden_size, embed_K,
                                                                                 device=device, generator=gen), config.pad_token_id)
            m.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            m.rotary_emb = LlamaRotaryEmbedding(config=config)  # inv_freq in fp32: computed with explicit dtypes
            if head_K is None:
                model.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                model.lm_head.weight.normal_(0, 0.02, generator=gen)
            else:
                model.lm_head = random_qlinear(config.hidden_size, config.vocab_size, head_K, device, gen)
            for i in tqdm(range(config.num_hidden_layers), desc=f"{arch} {'fp16' if K is None else f'K={K}'}", disable=not progress):
                with torch.device("meta"):
                    layer = LlamaDecoderLayer(config, i)
                for name, lin in list(layer.named_modules()):
                    if isinstance(lin, torch.nn.Linear):
                        if K is None:
                            new = torch.nn.Linear(lin.in_features, lin.out_features, bias=False)
                            new.weight.normal_(0, 0.02, generator=gen)
                        else:
                            new = random_qlinear(lin.in_features, lin.out_features, K, device, gen)
                            new.rotation = 0 if rotates_at_run_time(name, rotate) else None
                        parent, _, child = name.rpartition(".")
                        setattr(layer.get_submodule(parent), child, new)
                if fuse:
                    for parent, names in ((layer.self_attn, GROUPS["qkv_proj"]), (layer.mlp, GROUPS["gate_up_proj"])):
                        first = getattr(parent, names[0])
                        for n in names[1:]:
                            for b in getattr(first, "SHARED", ()):  # vector codebooks: one set a group
                                setattr(getattr(parent, n), b, getattr(first, b))
                    fuse_projections(layer)
                layer.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
                layer.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
                m.layers[i] = layer
    finally:
        torch.set_default_dtype(prev)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"random_llama left tensors unallocated: {left[:5]}")
    if K is not None or head_K is not None or embed_K is not None:
        model.trapetum_quant = {"K": K, "excluded": {}, "layers": {
            n: {"K": head_K if n == "lm_head" else K, "in_features": mod.in_features, "out_features": mod.out_features, "bias": False,
                **({} if mod.rotation is None else {"rotation": mod.rotation})}
            for n, mod in model.named_modules() if isinstance(mod, QLinear)},
            "embeddings": {} if embed_K is None else {"model.embed_tokens": model.model.embed_tokens.spec()}}
    return model.eval()


def load(name: str, device=None, dtype=None, quantize: int | None = None, exclude=(), min_features: int = 0, progress=True,
         embedding: bool = False, joint: bool = False, calibrate: int = 0, calib_source: str = "generated", calib_len: int = 512,
         finetune: int = 0, rotate: bool | str = False):
    """(model, tokenizer or None) from a saved quantized folder, a local model folder, a hub id or 'smollm2-135m'.
    ``quantize``, ``exclude``, ``min_features``, ``embedding``, ``joint``: as :func:`trapetum.qlinear.quantize_model`;
    ``calibrate`` > 0: calibration-aware, on that many samples of ``calib_len`` tokens from ``calib_source``
    ("generated": sampled from the model itself, offline; or a :func:`trapetum.pipelines.calibration_text` source);
    ``finetune`` > 0: then that many epochs of distillation over the same samples (quantize_model's ``finetune``);
    ``rotate``: the layers fitted to, and run on, randomly rotated inputs (quantize_model's ``rotate``: True, or
    "stream" for the residual stream rotated and down_proj's inputs at run time)."""
    from . import ppl
    from .qlinear import is_quantized_folder, load_quantized, quantize_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = torch.float16 if torch.device(device).type == "cuda" else torch.float32
    if is_quantized_folder(name):
        if quantize:
            raise ValueError(f"{name} is already quantized; drop --quantize")
        model = load_quantized(name, device=device, dtype=dtype)
        tok = None
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError):
            pass
        return model, tok
    model, tok = ppl.load_model(name, dtype=dtype)
    calib = None
    if rotate and not quantize:
        raise ValueError("rotate goes with quantize (the codes are fitted to the rotated layer)")
    if calibrate and not quantize:
        raise ValueError("calibrate goes with quantize (it calibrates the quantizer)")
    if finetune and not calibrate:
        raise ValueError("finetune goes with calibrate (it trains on the calibration samples)")
    if calibrate:
        model = model.to(device).eval()  # the calibration forwards run where the model will
        from .pipelines import calibration_tokens

        calib = calibration_tokens(model, tok, calibrate, calib_source, calib_len, progress=progress)[0]
    if quantize:
        quantize_model(model, K=quantize, exclude=exclude, min_features=min_features, progress=progress, embedding=embedding,
                       device=device if torch.device(device).type == "cuda" else None, joint=joint, calib=calib,
                       finetune=finetune or None, rotate=rotate)
    return model.to(device).eval(), tok


# -- benchmark ------------------------------------------------------------------------------------
ROTATED = ", inputs rotated"  # what a rotated row's scheme name ends in (decode_bench's rotates)
STREAM_ROTATED = ", stream rotated"  # ... and a row of rotate="stream"
ROTATE_CHOICES = {"off": (False,), "on": (True,), "stream": ("stream",), "both": (False, True), "all": (False, True, "stream")}
SCHEME_NAMES = {None: "fp16", 16: "4-bit K=16", 64: "uint8 K=64", 256: "uint8 K=256",
                "A2": "2-bit additive (M=2)", "A4": "4-bit additive (M=4)"}


def scheme_label(K) -> str:
    """A scheme's name in tables: SCHEME_NAMES, or "residual <main>+<residual> (<b> bits)"."""
    if _kind(K) == "residual":
        return f"residual {K[1:]} ({_bits(K):g}-bit indices)"
    return SCHEME_NAMES.get(K, f"K={K}")


def _bits(K):
    """Code bits per weight: 16 for fp16, M for additive "A<M>", the index bits over 8 for residual
    "R<main>+<residual>", else 4 (K=16) or 8."""
    if K is None:
        return 16.0
    from .qlinear import parse_scheme

    kind, params = parse_scheme(K)
    if kind == "residual":
        from .residual import index_bits_per_weight

        return index_bits_per_weight(*params)
    if kind == "additive":
        return float(params[0])
    return 8 / (2 if params[0] == 16 else 1)


def projection_bits(model) -> float:
    """Bits per weight of the decoder projections, codebooks and scales included (16 for fp16);
    a quantized LM head is not a projection."""
    qs = [q for n, q in qlinears(model).items() if n != "lm_head"]
    if not qs:
        return 16.0
    n = [q.in_features * q.out_features for q in qs]
    return sum(q.bits_per_weight * k for q, k in zip(qs, n)) / sum(n)


def projection_shapes(cfg, fused: bool = False) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection (kernel launch) of one Llama decoder layer;
    ``fused``: q/k/v and gate/up as one layer each (:mod:`trapetum.fuse`)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    if fused:
        return {"qkv_proj": (h, h + 2 * kv), "o_proj": (h, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
    return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


STEP_OPS = {"qkv_proj": ("rms", ""), "o_proj": ("", "add"), "gate_up_proj": ("rms", ""), "down_proj": ("silu", "add")}
"""What :class:`trapetum.step.FusedStep` fuses into each (fused) projection's kernel: (pre, post)."""


def kernel_bound(cfg, K: int | None, head_K: int | None = None, fused: bool = False, step: bool = False) -> dict:
    """The tok/s the projection and lm_head kernels alone allow: each shape timed as CUDA-graph
    replays over L2-rotated copies (trapetum.bench) at its fastest plan, summed over the layers.

    The graphed path's tok/s over this bound is the share of a token spent in these kernels;
    the rest is attention, norms, rotary, residual adds and the gaps between graph nodes. For a
    codebook K the result also names each kernel's plan (``kernel_plan_by_shape``) and the worst
    error of the kernels timed, each checked on fresh inputs (``kernel_max_rel_err``).

    ``step`` (a scalar or additive K, ``fused``): also the bound of the kernels the fused step itself
    launches (``step_*`` keys): each projection's kernel with the norm, SiLU or residual add it
    fuses (:data:`STEP_OPS`) at its own tuned plan (the lut or, for 4-bit codes, dual kernel; for additive weights the family
    the layer's batch-1 plan picks, table or streaming kernel, as :class:`~trapetum.qlinear.AdditiveQLinear`
    holds it), and a codebook LM head with its norm. These can be slower than the fastest plans (the
    mma, wide and tile kernels take no fused operations) but spare the step the separate norm,
    SiLU and add launches.
    """
    from . import bench

    from .qlinear import parse_scheme

    kind, params = (None, ()) if K is None else parse_scheme(K)
    times, recs = {}, {}  # recs: each timed codebook kernel's record (its plan and its checked error)
    shapes = list(projection_shapes(cfg, fused).values())
    for n_in, n_out in dict.fromkeys(shapes):  # each shape timed once, however many projections share it
        fp16 = bench.time_fp16(n_in, n_out, 1)
        if kind is None:
            times[(n_in, n_out)] = fp16
            continue
        if kind == "residual":
            from .residual import time_residual

            rec = time_residual(n_in, n_out, *params, 1, fp16)
        elif kind == "additive":
            from .additive import time_additive

            rec = time_additive(n_in, n_out, params[0], 1, fp16)
        else:
            rec = bench.time_lut(n_in, n_out, K, 1, "lut", fp16)
        recs[(n_in, n_out)], times[(n_in, n_out)] = rec, rec["time_ms"]
    per_layer = sum(times[s] for s in shapes)
    head = bench.time_fp16(cfg.hidden_size, cfg.vocab_size, 1)
    if head_K is not None:
        recs["lm_head"] = bench.time_lut(cfg.hidden_size, cfg.vocab_size, head_K, 1, "lut", head)
        head = recs["lm_head"]["time_ms"]
    ms = cfg.num_hidden_layers * per_layer + head
    out = {"kernel_ms_per_token": ms, "implied_tok_s": 1e3 / ms, "lm_head_ms": head,
           "kernel_ms_by_shape": json.dumps({f"{a}x{b}": t for (a, b), t in times.items()})}
    if recs:
        name = {k: k if isinstance(k, str) else f"{k[0]}x{k[1]}" for k in recs}
        out.update(kernel_plan_by_shape=json.dumps({name[k]: _plan_label(r) for k, r in recs.items()}),
                   kernel_max_rel_err=max(r["max_rel_err"] for r in recs.values()))
    if step and fused and kind in ("scalar", "additive"):
        from .additive import time_fused_additive

        op_ms = time_fused_additive if kind == "additive" else bench.time_fused  # (n_in, n_out, K or M, pre, post)
        by_op = {name: op_ms(n_in, n_out, params[0], *STEP_OPS[name]) for name, (n_in, n_out) in projection_shapes(cfg, True).items()}
        by_op["lm_head"] = bench.time_fused(cfg.hidden_size, cfg.vocab_size, head_K, "rms") if head_K is not None else head
        step_ms = cfg.num_hidden_layers * sum(v for k, v in by_op.items() if k != "lm_head") + by_op["lm_head"]
        out.update(step_kernel_ms_per_token=step_ms, step_implied_tok_s=1e3 / step_ms, step_kernel_ms_by_op=json.dumps(by_op))
    return out


def _plan_label(rec: dict) -> str:
    """The plan a timing record ran, in words: the additive label, or the lut / residual plan's fields."""
    if rec.get("plan"):
        return rec["plan"]
    keys = ("plan_kernel", "variant", "warps", "rb", "ksplit", "stages", "walk", "lanes")
    return ", ".join(f"{k} {rec[k]}" for k in keys if rec.get(k) is not None)


def _release_gpu_memory() -> None:
    """Free what a finished model left behind, so the next model's peak is its own: cached blocks,
    and cuBLAS's per-stream workspaces (~0.1 GB after an fp16 7B run; torch keeps them until told)."""
    torch.cuda.empty_cache()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
        torch.cuda.empty_cache()


def profile_fused_step(model, input_ids: torch.Tensor, replays: int = 40, warmup: int = 50, programmatic: bool = True) -> dict:
    """Where a graphed fused-step token goes, in this process (its own tuned plans): after
    ``warmup`` replays, torch.profiler's CUDA kernel times over ``replays`` more. Returns wall_us
    (CUDA events over the same replays, profiler off), kernel_us (their sum), gaps_us and rows
    [kernel name, calls a token, us a token], the slowest first."""
    from torch.profiler import ProfilerActivity, profile

    from .step import FusedStep

    dev = _device_of(model)
    if dev.type != "cuda":
        raise RuntimeError("profile_fused_step times CUDA kernels and needs the model on a CUDA GPU")
    n = 2 + warmup + 2 * replays
    step = FusedStep(model, input_ids.shape[1] + n, n, programmatic=programmatic)
    step.prefill(input_ids.to(dev))
    _side_stream_call(step, dev)
    runner = CudaGraphRunner()
    runner.capture(step)
    for _ in range(warmup):
        runner.replay()
    with Timer(dev) as t:
        for _ in range(replays):
            runner.replay()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            runner.replay()
        torch.cuda.synchronize(dev)
    tot: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            d = tot.setdefault(e.name, [0, 0.0])
            d[0] += 1
            d[1] += e.device_time_total
    rows = sorted(([name, c / replays, us / replays] for name, (c, us) in tot.items()), key=lambda r: -r[2])
    wall = t.seconds / replays * 1e6
    kernels = sum(r[2] for r in rows)
    return {"wall_us": wall, "kernel_us": kernels, "gaps_us": wall - kernels, "rows": rows}


def programmatic_runs(asked, cuda: bool = True) -> tuple[bool, ...]:
    """The fused-step rows a bench runs for ``asked`` (True: launched programmatically, False: strictly
    serial), each once; one serial row where nothing launches programmatically (before sm_90, the
    simulator), so no two rows of a run are the same thing."""
    from .gemv import programmatic_kernels

    runs = tuple(dict.fromkeys(bool(v) for v in asked))
    if not runs:
        raise ValueError("programmatic: give True and/or False")
    return runs if cuda and programmatic_kernels() else (False,)


def decode_bench(arch: str = "llama-2-7b", Ks=(16,), paths=("graphed",), fp16_paths=("graphed",), gen_len: int = 512,
                 prompt_len: int = 32, eager_gen_len: int = 128, seed: int = 0, energy=True, progress=True,
                 device="cuda", kernel_times: bool = True, heads=(None,), fuses=(False,), embeds=(None,),
                 profile: bool = False, programmatic=(True,), on_record=None, rotates=(False,), **arch_overrides) -> list[dict]:
    """fp16 vs codebook decode on a Llama-2 architecture with random weights, built on the device.

    One record per (scheme, path), per the results contract; ``fp16_tok_s`` is the fp16 graphed
    run of the same process. fp16 runs first; if a model does not fit (70B fp16), the OOM is
    recorded (``oom`` True, tok_s None, the weight bytes it needed) and the next scheme still runs.
    Eager paths generate ``eager_gen_len`` tokens (they are Python-bound; the window is recorded).
    ``kernel_times``: also time each projection shape alone (:func:`kernel_bound`) and record the
    graphed path's share of that bound (a fused-step row also its share of its own kernels' bound,
    ``fraction_of_step_bound``). ``heads``: the LM head of each codebook scheme, fp16 (None)
    and/or a scalar K (one row each); ``embeds`` likewise for the token embedding (a
    :class:`~trapetum.qlinear.QEmbedding`: VRAM only, a token reads one row of it).
    ``device="cpu"`` with tiny ``arch_overrides`` is for tests only.

    Each model's peak VRAM is its own: the previous model's cuBLAS workspaces are released before
    the next is built (``vram_before_gb`` records what was still allocated).

    ``fuses``: False and/or True, each a pass over every scheme, fp16 included: True fuses each
    layer's q/k/v and gate/up (:mod:`trapetum.fuse`), and those rows (``fused`` True) are compared
    with the fused fp16 model.

    ``profile``: each fused-step row also records :func:`profile_fused_step` of the same model in
    the same process (``profile``, JSON), after its timed run.

    ``programmatic``: True and/or False, a fused-step row each: its kernels launched so that each
    may start while the one before runs (sm_90), or strictly one after another.

    ``rotates``: False, True and/or "stream", a row each for every codebook scheme: True rotates every decoder projection's
    inputs (:mod:`trapetum.hadamard`; ``rotate`` True, the scheme named "..., inputs rotated"), "stream" down_proj's only
    (random_llama's ``rotate="stream"``, "..., stream rotated"). The kernel bounds
    count the GEMVs only, so a rotated row's share of them also says what its rotation launches cost.

    ``on_record(rec)`` sees each record as it is made (the CLI's partial file: a run cut short keeps
    the rows it finished).
    """
    if profile and torch.device(device).type != "cuda":
        raise ValueError("profile=True times CUDA kernels: it needs device='cuda'")
    import gc

    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        from .gemv import NoGPUError

        raise NoGPUError("decode_bench measures on a CUDA GPU and none is visible")
    cfg = llama_config(arch, **arch_overrides)
    pdl_runs = programmatic_runs(programmatic, cuda)
    recs = []
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=g)
    # Each record's fp16 baselines and bytes a token reads (fp16 runs first, so a record made later
    # can be completed at once: the partial file's rows carry them too).
    h, i, L, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = h * cfg.num_key_value_heads // cfg.num_attention_heads
    proj = L * (2 * h * h + 2 * h * kv + 3 * h * i)

    def complete(r: dict) -> dict:
        key = (r["path"], r["fused"])
        f = fp16_tok_s.get(key, fp16_tok_s.get(("graphed", r["fused"])))
        r["fp16_tok_s"] = f
        r["fp16_vram_gb"] = fp16_vram.get(key, fp16_vram.get(("graphed", r["fused"])))
        r["speedup"] = r["tok_s"] / f if r.get("tok_s") and f else None
        # Against the fastest fp16 path of the run (a codebook path may beat fp16 on a slower path only)
        best = max(((v, p) for (p, fu), v in fp16_tok_s.items() if fu == r["fused"] and p in GRAPHED and v), default=None)
        r["fp16_best_path"] = best[1] if best else None
        r["speedup_vs_best_fp16"] = r["tok_s"] / best[0] if r.get("tok_s") and best else None
        # Bytes a token must read at least (projections at their bits, embeddings/lm_head fp16): the bandwidth bound's numerator.
        K = r["K"]
        if K is None:
            per_w = 2.0
        elif isinstance(K, str):
            per_w = _bits(K) / 8  # codes; codebooks (8 KiB a layer) and scales are negligible
        else:
            per_w = 1 / (2 if K == 16 else 1) + K * 2 / h  # codes + codebook share (in >= hidden)
        head_w = 2.0 if r["head_K"] is None else 1 / (2 if r["head_K"] == 16 else 1) + r["head_K"] * 2 / h
        r["weight_bytes_per_token"] = proj * per_w + head_w * v * h
        if r.get("oom"):
            r["weights_gb_needed"] = (proj * per_w + (2 + head_w) * v * h) / 1e9
        return r

    fp16_tok_s = {}  # fp16's tok/s by (graphed path, fused): each path is compared with fp16 on the same path
    fp16_vram = {}
    runs = [(f, K, h, e, r) for f in fuses
            for K, h, e, r in [(None, None, None, False)] + [(K, h, e, r) for K in Ks for h in heads for e in embeds for r in rotates]]
    for fused, K, head, embed, rotate in runs:
        scheme = scheme_label(K) + ("" if head is None else f", LM head {SCHEME_NAMES.get(head, head)}")
        scheme += "" if embed is None else f", embedding {SCHEME_NAMES.get(embed, embed)}"
        scheme += {True: ROTATED, "stream": STREAM_ROTATED}.get(rotate, "")
        model = None
        if cuda:
            _release_gpu_memory()
            torch.cuda.reset_peak_memory_stats()
        base = {"model": arch, "weights": "random", "architecture": "real (published config)", "scheme": scheme, "K": K,
                "head_K": head, "lm_head": SCHEME_NAMES.get(head, head), "embed_K": embed, "embedding": SCHEME_NAMES.get(embed, embed),
                "bits_per_weight_codes": _bits(K), "batch": 1, "rotate": rotate,
                "prompt_len": prompt_len, "fused": bool(fused), "vram_before_gb": torch.cuda.memory_allocated() / 1e9 if cuda else None}
        try:
            bound = {}
            if kernel_times and cuda:
                # before the model is built: the rotated copies need memory
                bound = kernel_bound(cfg, K, head, fused, step="fused-step" in paths)
                if progress:
                    print(f"{arch} {scheme}: projection + lm_head kernels {bound['kernel_ms_per_token']:.3f} ms/token "
                          f"-> {bound['implied_tok_s']:.1f} tok/s bound", flush=True)
                    if "step_implied_tok_s" in bound:
                        print(f"  the fused step's own kernels {bound['step_kernel_ms_per_token']:.3f} ms/token "
                              f"-> {bound['step_implied_tok_s']:.1f} tok/s bound", flush=True)
            t0 = time.time()
            model = random_llama(arch, K, device=device, seed=seed, progress=progress, head_K=head, fuse=fused, embed_K=embed,
                                 rotate=rotate, **arch_overrides)
            if not cuda:
                model.float()  # CPU matmuls in fp32 (tests); codebooks stay fp16
            else:
                torch.cuda.synchronize()
            weights_gb = torch.cuda.memory_allocated() / 1e9 if cuda else None
            build_s = time.time() - t0
            base["bits_per_weight"] = projection_bits(model)
            # Compile and tune the kernels (and let cuBLAS pick) before anything is measured: the
            # tuner's L2-sized copies of the codes must not count in the peak VRAM.
            generate(model, prompt, 3, path="eager", energy=False)
            for path, pdl in [(p, g) for p in (fp16_paths if K is None else paths) for g in (pdl_runs if p == "fused-step" else (None,))]:
                n = gen_len if path in GRAPHED else min(gen_len, eager_gen_len)
                # On CPU (tests) the graphed path replays through the stand-in runner.
                runner = FakeGraphRunner() if path in GRAPHED and not cuda else None
                r = generate(model, prompt, n, path=path, energy=energy, runner=runner, programmatic=pdl is not False)
                rec = {**base, "path": path, "gen_len": n, "tok_s": r.tok_s, "vram_gb": r.peak_vram_gb,
                       "weights_gb": weights_gb, "j_per_token": r.j_per_token, "mean_w": r.mean_w,
                       "energy_error": r.energy_error, "decode_seconds": r.decode_seconds,
                       "prefill_seconds": r.prefill_seconds, "timed_tokens": r.extra["timed_tokens"],
                       "build_seconds": build_s, "oom": False, "first_tokens": r.tokens[:32]}
                if "fused_plans" in r.extra:  # which plan each fused GEMV ran: plans are tuned per process
                    rec["fused_plans"] = json.dumps(r.extra["fused_plans"])
                    rec["programmatic"] = r.extra["programmatic"]  # asked for and available (sm_90)
                if profile and path == "fused-step":
                    prof = profile_fused_step(model, prompt, programmatic=pdl is not False)
                    rec["profile"] = json.dumps(prof)
                    if progress:
                        print(f"  profile: wall {prof['wall_us']:.1f} us a token, kernels {prof['kernel_us']:.1f}", flush=True)
                        for name, c, us in prof["rows"][:8]:
                            print(f"  {us:9.1f} us a token {c:6.1f} calls  {name[:90]}", flush=True)
                if path in GRAPHED and bound:
                    rec.update({k: v for k, v in bound.items() if not k.startswith("step_")},
                               fraction_of_kernel_bound=r.tok_s / bound["implied_tok_s"])
                    if path == "fused-step" and "step_implied_tok_s" in bound:
                        rec.update({k: v for k, v in bound.items() if k.startswith("step_")},
                                   fraction_of_step_bound=r.tok_s / bound["step_implied_tok_s"])
                if K is None and path in GRAPHED:
                    fp16_tok_s[path, fused] = r.tok_s
                    fp16_vram[path, fused] = r.peak_vram_gb
                recs.append(rec)
                if on_record is not None:
                    on_record(complete({**rec, "first_tokens": " ".join(map(str, rec["first_tokens"]))}))
                if progress:
                    vram = f"{r.peak_vram_gb:6.2f} GB" if r.peak_vram_gb is not None else "n/a"
                    jpt = f"{r.j_per_token:.3f}" if r.j_per_token is not None else f"n/a ({r.energy_error})"
                    label = path + (" fused" if fused else "") + (" serial" if pdl is False else "")
                    print(f"{arch} {scheme:12s} {label:14s} {r.tok_s:8.1f} tok/s  peak {vram}  J/token {jpt}", flush=True)
        except torch.cuda.OutOfMemoryError as e:
            recs.append({**base, "path": "graphed", "gen_len": gen_len, "tok_s": None, "vram_gb": None, "j_per_token": None,
                         "oom": True, "error": str(e).splitlines()[0][:300],
                         "gpu_memory_gb": torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else None})
            if on_record is not None:
                on_record(complete(dict(recs[-1])))
            if progress:
                print(f"{arch} {scheme}: out of memory ({str(e).splitlines()[0][:120]})", flush=True)
        finally:
            del model
            gc.collect()
            if cuda:
                _release_gpu_memory()
    # The same model must decode the same tokens whoever launches the step: eager vs graphed
    # exactly; naive (DynamicCache, fp32 casts) may drift late. Stored as text (JSON-flat).
    for r in recs:
        same = ("K", "head_K", "embed_K", "fused", "rotate")
        ref = next((x for x in recs if all(x[k] == r[k] for k in same) and x.get("path") == "graphed"
                    and not x.get("oom")), None)
        if ref is not None and not r.get("oom"):
            a, b = r["first_tokens"], ref["first_tokens"]
            k = min(len(a), len(b))
            r["matches_graphed_tokens"] = a[:k] == b[:k]
    for r in recs:
        if "first_tokens" in r:
            r["first_tokens"] = " ".join(map(str, r["first_tokens"]))
    for r in recs:
        complete(r)
    return recs


# -- command line ---------------------------------------------------------------------------------
def _generate_cmd(args) -> int:
    from .energy import projections
    from .qlinear import FINETUNE_LR

    K = _parse_quantize(args.quantize)
    if args.quantize_embedding and K is None:
        raise SystemExit("--quantize-embedding goes with --quantize (the embedding takes the projections' K)")
    if args.quantize_embedding and not isinstance(K, int):
        raise SystemExit(f"--quantize-embedding takes a scalar codebook (K16, K64, K256), not {K}")
    if args.calibrate and K is None:
        raise SystemExit("--calibrate goes with --quantize (it calibrates the quantizer)")
    if args.rotate and K is None:
        raise SystemExit("--rotate goes with --quantize (the codes are fitted to the rotated layer)")
    if args.finetune and not args.calibrate:
        raise SystemExit("--finetune goes with --calibrate N (it trains on those N samples)")
    if args.finetune and _kind(K) not in FINETUNE_LR:
        raise SystemExit(f"--finetune trains scalar (K16, K64, K256) and additive (A2, A4) codebooks, not {K}")
    # --fuse: vector-codebook groups quantized jointly, since layers with separate codebooks do not fuse
    model, tok = load(args.model, device=args.device, quantize=K, exclude=tuple(args.exclude or ()), min_features=args.min_features,
                      embedding=args.quantize_embedding, joint=args.fuse, calibrate=args.calibrate, calib_source=args.calib_source,
                      calib_len=args.calib_len, finetune=args.finetune,
                      rotate={None: False, "inputs": True, "stream": "stream"}[args.rotate])
    ft = getattr(model, "trapetum_quant", {}).get("finetune")
    if ft and args.finetune:  # fine-tuned now (a saved model's record of it travels in trapetum.json)
        print(f"fine-tuned {ft['epochs']} epochs ({ft['seconds']:.0f} s): KL to the unquantized model on the first "
              f"{ft['eval_samples']} calibration samples {ft['kl_before']:.4f} -> {ft['kl_after']:.4f} nats/token")
    if args.save:
        from .qlinear import save_quantized

        print(f"saved {save_quantized(model, args.save, tokenizer=tok)}")
    if args.fuse:
        from .fuse import fuse_projections

        left = {k: v for k, v in fuse_projections(model).items() if v != "fused"}
        if left:
            print(f"not fused: {len(left)} groups, e.g. {next(iter(left))}: {next(iter(left.values()))}")
    if tok is None:
        raise SystemExit(f"{args.model} has no tokenizer files: cannot encode --prompt")
    ids = tok(args.prompt, return_tensors="pt").input_ids
    r = generate(model, ids, args.max_new_tokens, path=args.path, energy=not args.no_energy)
    print(tok.decode(ids[0].tolist() + r.tokens, skip_special_tokens=True))
    print(f"path {r.path}: {r.tok_s:.1f} tok/s over {r.extra['timed_tokens']} tokens; prefill {r.prefill_seconds * 1e3:.1f} ms")
    print("peak VRAM: " + (f"{r.peak_vram_gb:.2f} GB" if r.peak_vram_gb is not None else "n/a (CPU)"))
    if r.j_per_token is not None:
        proj = projections(r.j_per_token)
        print(f"energy: {r.j_per_token:.3f} J/token (mean {r.mean_w:.0f} W); projected gCO2/1k tokens: "
              + ", ".join(f"{k.split('_')[3]} {v:.3f}" for k, v in proj.items()) + " (projection, not a measurement)")
    else:
        print(f"energy: not measured ({r.energy_error or 'disabled'})")
    return 0


def _check_cmd(args) -> int:
    from . import results

    paths = [p for p in args.path.split(",") if p]
    bad = sorted(set(paths) - set(GRAPHED))
    if bad or not paths:
        raise SystemExit(f"--path takes a comma-separated list of {GRAPHED}, got {args.path!r}")
    K = _parse_quantize(args.quantize)
    model, tok = load(args.model, device=args.device, quantize=K)
    if tok is None:
        raise SystemExit(f"{args.model} has no tokenizer files: cannot encode --prompt")
    ids = tok(args.prompt, return_tensors="pt").input_ids
    recs = []
    for path in paths:  # one model load for every path: each is checked against the same eager run's tokens
        r = check_equivalence(model, ids, args.tokens, path=path)
        tol = args.tol if args.tol is not None else CHECK_TOL[path]
        ok = r["first_mismatch"] is None and r["max_rel_logit_diff"] <= tol
        print(f"{args.model} {scheme_label(K)}: {path} vs eager, {r['matching_prefix']}/{r['tokens']} tokens equal, "
              f"max |logit diff| {r['max_abs_logit_diff']:.3g} ({r['max_rel_logit_diff']:.3g} of the largest logit): "
              f"{'OK' if ok else 'MISMATCH'}")
        print("eager:  ", tok.decode(r["reference_tokens"]))
        print(f"{path}:", tok.decode(r["graphed_tokens"]))
        recs.append({"model": args.model, "weights": "real", "scheme": SCHEME_NAMES.get(K, K), "check": f"{path} vs eager",
                     "passed": ok, "tol": tol, "prompt": args.prompt,
                     **{k: (str(v) if isinstance(v, list) else v) for k, v in r.items()}})
    if args.out:
        print(f"wrote {results.save(args.name, recs, results.provenance(), folder=args.out)}")
    return 0 if all(r["passed"] for r in recs) else 1


def _parse_quantize(spec):
    from .qlinear import SCHEME_HELP, parse_scheme

    if spec in (None, "", "none", "fp16"):
        return None
    s = str(spec).upper()
    try:
        kind, params = parse_scheme(s)
    except ValueError:
        raise SystemExit(f"--quantize takes {SCHEME_HELP}, got {spec!r}") from None
    return params[0] if kind == "scalar" else s


FUSE_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}


def _bench_cmd(args) -> int:
    from . import results

    t0 = time.time()
    recs = []
    command = args.command or None  # None: provenance records this process's invocation
    partial = None
    if args.out and torch.cuda.is_available():
        # Each row as it is made, so a run stopped part way (a device call's time limit) keeps what it
        # measured: results.adopt_partial turns <out>/<gpu>/<name>.partial.jsonl into a results file.
        partial = results.write_partial(args.name, torch.cuda.get_device_name(), results.provenance(command=command), {}, [],
                                        folder=args.out)
    for arch in args.arch.split(","):
        recs += decode_bench(arch, Ks=tuple(_parse_quantize(k) for k in args.schemes.split(",")), paths=tuple(args.paths.split(",")),
                             fp16_paths=tuple(args.fp16_paths.split(",")), gen_len=args.gen, prompt_len=args.prompt_len,
                             eager_gen_len=args.eager_gen, energy=not args.no_energy, kernel_times=not args.no_kernel_times,
                             heads=tuple(_parse_quantize(k) for k in args.lm_head.split(",")), fuses=FUSE_CHOICES[args.fuse],
                             embeds=tuple(_parse_quantize(k) for k in args.embed.split(",")), profile=args.profile,
                             programmatic={"on": (True,), "off": (False,), "both": (True, False)}[args.programmatic],
                             rotates=ROTATE_CHOICES[args.rotate],
                             on_record=None if partial is None else (lambda r: results.append_partial(partial, r)))
    prov = results.provenance(command=command, seconds=round(time.time() - t0, 1))
    path = results.save(args.name, recs, prov, folder=args.out)
    if partial is not None:
        partial.unlink()  # the whole run is in the results file now
    print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trapetum.decode", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="greedy generation with tok/s, peak VRAM and J/token")
    g.add_argument("model", help="hub id, local model folder, folder saved by save_quantized, or smollm2-135m")
    g.add_argument("--prompt", default="The capital of France is", help="text to continue (default: %(default)r)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate, greedily (default: %(default)s)")
    g.add_argument("--path", choices=PATHS, default="graphed",
                   help="how each token runs: naive (model forwards, layers cast to fp32 and back), eager (the cast-free "
                        "static-cache step, run by Python), graphed (that step, one CUDA-graph replay a token), compiled "
                        "(it through torch.compile, graphed), fused-step (Trapetum's fused kernels, graphed); default: %(default)s")
    g.add_argument("--quantize", default=None, help="K16 | K64 | K256 | A2 | A4 | R<main>+<residual>, e.g. R4096+256 "
                                                   "(default: run the model as loaded)")
    g.add_argument("--exclude", action="append", help="glob of layer names to keep in fp16 (repeatable)")
    g.add_argument("--min-features", type=int, default=0,
                   help="keep layers whose smaller side is below this in fp16 (seed 004 quantizes only large layers); default: all")
    g.add_argument("--quantize-embedding", action="store_true", help="the token embedding too (QEmbedding; saves VRAM)")
    g.add_argument("--calibrate", type=int, default=0, metavar="N",
                   help="calibration-aware quantizing on N samples (activation-aware k-means for K16..K256, H-weighted "
                        "additive and residual codebooks); without it the quantizer minimises the plain weight error")
    g.add_argument("--calib-source", default="generated", choices=["generated", "pydoc", "wikitext2-train", "auto"],
                   help="generated: sampled from the model itself (needs no data); pydoc: CPython's documentation text")
    g.add_argument("--calib-len", type=int, default=512, help="tokens a calibration sample")
    g.add_argument("--finetune", type=int, default=0, metavar="EPOCHS",
                   help="after a calibrated K16..K256, A2 or A4 quantizing, train the codebooks and norms (codes fixed) for "
                        "EPOCHS passes over the calibration samples, to match the unquantized model's next-token "
                        "distribution; keeps a copy of the model while it runs")
    g.add_argument("--rotate", nargs="?", const="inputs", choices=("inputs", "stream"), default=None,
                   help="fit every layer to randomly rotated inputs (QuIP#'s incoherence processing, inputs only: the accuracy "
                        "chapter's additive-hadamard:outputs=false): 'inputs' (the default) rotates x before each GEMV, one launch "
                        "more a projection group; 'stream' rotates the residual stream once, offline (QuaRot: the norms folded "
                        "into the layers), so that only down_proj rotates at run time, one launch a layer"),
    g.add_argument("--save", default=None, help="write the quantized model to this folder")
    g.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: the GPU where there is one)")
    g.add_argument("--no-energy", action="store_true", help="skip the NVML power sampling (J/token)")
    g.add_argument("--fuse", action="store_true", help="fuse q/k/v and gate/up into one layer each (after --save: the saved format is "
                   "unfused); with --quantize A2/A4/R..., each group is quantized jointly (one codebook set) so that it can fuse")
    g.set_defaults(func=_generate_cmd)
    c = sub.add_parser("check", help="graphed vs eager: greedy tokens and logits of the same model must match")
    c.add_argument("model", help="as for generate (smollm2-135m is the offline real model)")
    c.add_argument("--quantize", default="K16")
    c.add_argument("--prompt", default="The capital of France is")
    c.add_argument("--tokens", type=int, default=32)
    c.add_argument("--path", default="graphed", help=f"graphed path(s) checked against eager, comma-separated, of {GRAPHED}")
    c.add_argument("--tol", type=float, default=None,
                   help="largest allowed logit difference, relative to the largest logit (default per path: "
                        + ", ".join(f"{k} {v:g}" for k, v in CHECK_TOL.items()) + ")")
    c.add_argument("--device", default=None)
    c.add_argument("--out", default=None, help="also write <out>/<gpu>/<name>.json")
    c.add_argument("--name", default="decode-check")
    c.set_defaults(func=_check_cmd)
    b = sub.add_parser("bench", help="Llama-2 architectures, random weights: fp16 vs codebook decode; writes <out>/<gpu>/<name>.json")
    b.add_argument("--arch", default="llama-2-7b,llama-2-13b", help=f"comma-separated, of {sorted(LLAMA2)}")
    b.add_argument("--schemes", default="K16")
    b.add_argument("--paths", default="naive,eager,graphed,compiled,fused-step", help="paths for the codebook models")
    b.add_argument("--fp16-paths", default="naive,eager,graphed,compiled,fused-step",
                   help="naive = transformers-style loop with DynamicCache (the usual fp16 baseline)")
    b.add_argument("--lm-head", default="fp16", help="LM head of the codebook schemes: fp16 and/or K16 (comma-separated, a row each)")
    b.add_argument("--embed", default="fp16", help="token embedding of the codebook schemes: fp16 and/or K16 (comma-separated, "
                                                   "a row each; saves VRAM, a token reads one row)")
    b.add_argument("--gen", type=int, default=512)
    b.add_argument("--eager-gen", type=int, default=128, help="tokens for the naive/eager paths (Python-bound, slower)")
    b.add_argument("--prompt-len", type=int, default=32, help="> 16, so the prefill takes dequant+cuBLAS and no batch-16 kernel is tuned")
    b.add_argument("--out", default=None, help="results folder (default: the repository's data/)")
    b.add_argument("--name", default="decode")
    b.add_argument("--command", default=None)
    b.add_argument("--no-energy", action="store_true")
    b.add_argument("--no-kernel-times", action="store_true", help="skip timing each projection shape alone (the kernel bound)")
    b.add_argument("--fuse", choices=sorted(FUSE_CHOICES), default="off",
                   help="q/k/v and gate/up as one layer each: off, on, or both (every scheme, fp16 included, twice)")
    b.add_argument("--profile", action="store_true",
                   help="fused-step rows also record a torch.profiler breakdown of a token (kernel by kernel) from the same process")
    b.add_argument("--programmatic", choices=("on", "off", "both"), default="on",
                   help="fused-step rows: kernels that may start while the one before runs (sm_90), strictly serial, or a row each")
    b.add_argument("--rotate", choices=tuple(ROTATE_CHOICES), default="off",
                   help="codebook schemes with every decoder projection's inputs rotated (on), the residual stream rotated "
                        "and down_proj's inputs at run time (stream), or a row each: off and on (both), off, on and stream (all)")
    b.set_defaults(func=_bench_cmd)
    args = p.parse_args(argv)
    if getattr(args, "max_new_tokens", 1) < 1:
        p.error("--max-new-tokens must be >= 1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
