"""QLinear, the nn.Linear of a codebook-quantized model, and whole-model quantize / save / load.

A QLinear holds the layer as a :class:`trapetum.codebook.CodebookTensor` (packed codes plus
one fp16 codebook a row, as buffers, so ``.to()`` and ``state_dict()`` work) and an optional
fp16 bias; :class:`AdditiveQLinear` (AQLM-style) and :class:`ResidualQLinear` (VPTQ-style) hold
the vector-codebook formats the same way (a layer's ``K``, its scheme: 16, "A2", "R4096+256"; see
:func:`parse_scheme`). Its forward dispatches on where the input is:

* CUDA, batch 1..16 (rows of the flattened input): the fused LUT-GEMV kernel
  (:class:`trapetum.gemv.LutGemv`), fp16 in, fp16 out, into a freshly allocated output, so a
  CUDA-graph capture of the forward records the launch with the graph pool's addresses;
* CUDA, larger batches (prefill): dequantize on the device, then torch's matmul (cuBLAS),
  because the fused kernel's cost grows with the batch (NOTES.md, "Large batches");
* CPU: dequantize with torch and ``F.linear`` in the input's dtype, so CPU users and the test
  suite run any model without a GPU.

``mode = "naive"`` reproduces seed 004's first integration path, the per-layer custom-op swap
that casts every call's input to float32 and back (what an op registered for fp32 does);
the default ``"fast"`` keeps fp16 end to end and does no cast.

A saved model is a folder: ``model.safetensors`` (every tensor of the state dict; tied weights
once) and ``trapetum.json`` (format version, the base model config, each quantized layer's K
and shape, the excluded layers and why, the tied names, and a SHA-256 of every tensor), so
truncation and tampering are caught at load time, as :meth:`CodebookTensor.load` does for
one layer.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .codebook import (
    ROW_BLOCK,
    SUPPORTED_K,
    CodebookFormatError,
    CodebookTensor,
    check_in_features,
    codes_per_byte,
    packing_for,
    unpack_codes,
)

FORMAT_VERSION = 1
KIND = "trapetum-quantized-model"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "trapetum.json"
MODES = ("fast", "naive")


# The fused kernel as a torch custom op, so torch.compile treats it as one opaque call (with a
# shape-only fake implementation) and fuses the norms, rotary and activations around it.
# A layer is named by a handle into this registry: a custom op takes tensors and numbers only.
_LAYERS: "weakref.WeakValueDictionary[int, QLinear]" = weakref.WeakValueDictionary()


@torch.library.custom_op("trapetum::qlinear_gemv", mutates_args=())
def qlinear_gemv(x: torch.Tensor, handle: int) -> torch.Tensor:
    """y (B, out) = the fused kernel of QLinear ``handle`` on x (B, in), fp16."""
    layer = _LAYERS.get(handle)
    if layer is None:
        raise RuntimeError(f"no QLinear is registered under handle {handle} (the layer was freed or copied)")
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # the kernels read x 16 bytes at a time
    y = torch.empty(x.shape[0], layer.out_features, dtype=torch.float16, device=x.device)
    layer.gemv().bind(x, y)()
    return y


@qlinear_gemv.register_fake
def _(x, handle):
    return x.new_empty(x.shape[0], _LAYERS[handle].out_features)


@torch.library.custom_op("trapetum::qlinear_rotate", mutates_args=())
def qlinear_rotate(x: torch.Tensor, handle: int) -> torch.Tensor:
    """x (B, in) U^T, the input rotation of QLinear ``handle`` (:class:`trapetum.hadamard.Rotation`), fp16."""
    layer = _LAYERS.get(handle)
    if layer is None:
        raise RuntimeError(f"no QLinear is registered under handle {handle} (the layer was freed or copied)")
    return layer.rotator()(x, simulate=layer.simulate)


@qlinear_rotate.register_fake
def _(x, handle):
    return torch.empty_like(x)


SLAB_BYTES = 16 * 2**20  # fp16 weight rebuilt at a time by dequant_matmul


def dequant_matmul(x2: torch.Tensor, g) -> torch.Tensor:
    """``x2 @ W.T`` for batches the fused kernel does not take (prefill): cuBLAS on the fp16 weight,
    rebuilt a slab of rows at a time (``g.dequantize(rows=...)``). The whole fp16 weight at once was
    the peak of a 7B decode's memory: 90 MB for an MLP layer, ~450 MB of fp32 transients for an
    additive one, beside 3.2 GB of 4-bit codes."""
    n_out, n_in = g.n_out, g.n_in
    step = max(ROW_BLOCK, SLAB_BYTES // (2 * n_in) // ROW_BLOCK * ROW_BLOCK)
    yt = torch.empty(n_out, x2.shape[0], dtype=torch.float16, device=x2.device)
    for r0 in range(0, n_out, step):
        r1 = min(n_out, r0 + step)
        torch.mm(g.dequantize(rows=(r0, r1)), x2.t(), out=yt[r0:r1])
    return yt.t().contiguous()


class QuantizedModelError(ValueError):
    """A saved quantized model is missing, corrupt, tampered or does not match its config."""


def _kmeans_weight(module: nn.Module, kind: type, K: int, iters: int, seed: int, device, importance=None):
    """Per-row k-means of ``module.weight`` (:func:`trapetum.codebook.quantize`, run on ``device``;
    ``importance`` (in,) weighs each input column), returned on the weight's device with the report."""
    from .codebook import quantize

    if not isinstance(module, kind):
        raise TypeError(f"expected an nn.{kind.__name__}, got {type(module).__name__}")
    ct, rep = quantize(module.weight.detach().float(), K=K, iters=iters, seed=seed, importance=importance, device=device)
    return ct.to(module.weight.device), rep


class QLinear(nn.Module):
    """``y = x @ W_hat.T + b`` with ``W_hat`` a codebook weight; a drop-in for ``nn.Linear``.

    ``rotation`` (every format): None, or the seed of a served input rotation U
    (:class:`trapetum.hadamard.Rotation`, regenerated, not stored): then the codes hold the layer fitted
    as W U^T and the forward computes ``(U x) @ W_hat.T + b``, one fp16 transform of x before the
    unchanged kernel (``quantize_model(..., rotate=True)``). :mod:`trapetum.fuse` stacks only layers of one
    rotation; the fused decode step launches the rotation (with the GEMV's RMSNorm or SiLU) before the GEMVs.
    """

    rotation: int | None = None
    _rot = None

    def __init__(self, in_features: int, out_features: int, K: int = 16, bias: bool = False, device=None):
        super().__init__()
        packing_for(K)
        check_in_features(in_features, K)
        if out_features <= 0:
            raise ValueError(f"out_features must be positive, got {out_features}")
        self.in_features, self.out_features, self.K = in_features, out_features, K
        self.register_buffer("codes", torch.zeros(out_features, in_features // codes_per_byte(K), dtype=torch.uint8, device=device))
        self.register_buffer("codebook", torch.zeros(out_features, K, dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float16, device=device) if bias else None)
        self.mode = "fast"
        # Tests set this under NUMBA_ENABLE_CUDASIM to run the kernel dispatch on CPU tensors.
        self.simulate = False
        self._gemv = None
        self._codes_in_kernel = False

    @classmethod
    def from_codebook(cls, ct: CodebookTensor, bias: torch.Tensor | None = None) -> "QLinear":
        ct.validate()
        q = cls(ct.in_features, ct.out_features, ct.K, bias=bias is not None, device="meta")
        q.codes, q.codebook = ct.codes, ct.codebook
        q._take_bias(bias)
        return q

    def _take_bias(self, bias: torch.Tensor | None) -> None:
        """The from_* constructors' bias: an fp16 copy beside the codes, checked against out_features."""
        if bias is not None:
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"bias shape {tuple(bias.shape)} != ({self.out_features},)")
            self.bias = bias.detach().to(device=self.codes.device, dtype=torch.float16).clone()

    @classmethod
    def from_linear(cls, linear: nn.Linear, K: int = 16, iters: int = 25, seed: int = 0, device=None, importance=None):
        """Per-row k-means of ``linear.weight`` (:func:`trapetum.codebook.quantize`; ``importance``: the
        activation-aware weights of its input columns, E[x_i^2]); returns (QLinear, report)."""
        ct, rep = _kmeans_weight(linear, nn.Linear, K, iters, seed, device, importance)
        return cls.from_codebook(ct, linear.bias), rep

    def codebook_tensor(self) -> CodebookTensor:
        """The weight as a CodebookTensor (validated: dtypes, shapes, finite codebooks, code range)."""
        if self._codes_in_kernel:
            return self._kernel_weight()  # rebuilt from the kernel's tiled copy
        return CodebookTensor(self.codes, self.codebook, self.K, self.in_features, self.out_features)

    def _kernel_weight(self):
        """The weight in the natural layout, rebuilt from the kernel's tiled codes (a copy)."""
        return self._gemv.ct

    # On a GPU the codes live once, in the kernel's tiled layout: the natural buffer is released
    # when the kernel is built, and rebuilt (a permuted copy) for state_dict, moves and dequantize.
    # Holding both cost a second copy of every weight (7.9 GB instead of ~4.5 GB at 7B).
    def _natural_codes(self) -> torch.Tensor:
        """The ``codes`` buffer's contents rebuilt from the kernel's copy."""
        return self._kernel_weight().codes

    def _restore_codes(self) -> None:
        if self._codes_in_kernel:
            self.codes = self._natural_codes()
            self._codes_in_kernel = False

    def _release_codes(self) -> None:
        self.codes = torch.empty(0, dtype=self.codes.dtype, device=self.codes.device)
        self._codes_in_kernel = True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._codes_in_kernel:
            destination[prefix + "codes"] = self._natural_codes()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._restore_codes()
        self._gemv = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantize(self, dtype=torch.float16) -> torch.Tensor:
        """The stored weight decoded: for a rotated layer, in the rotated basis (see :meth:`effective_weight`)."""
        return self.codebook_tensor().dequantize(dtype)

    def rotator(self):
        """The :class:`~trapetum.hadamard.Rotation` of this layer's inputs (ValueError if it has none)."""
        if self.rotation is None:
            raise ValueError("this layer has no input rotation")
        if self._rot is None or (self._rot.n, self._rot.seed) != (self.in_features, self.rotation):
            from .hadamard import Rotation

            self._rot = Rotation(self.in_features, self.rotation)
        return self._rot

    def effective_weight(self, dtype=torch.float32) -> torch.Tensor:
        """The weight the layer applies to its inputs as they arrive: dequantize() U for a rotated layer."""
        W = self.dequantize(torch.float32)
        if self.rotation is not None:
            W = W @ self.rotator().matrix(torch.float32).to(W.device)
        return W.to(dtype)

    def _rotation_repr(self) -> str:
        return "" if self.rotation is None else f", rotation={self.rotation}"

    @property
    def bits_per_weight(self) -> float:
        return 8 / codes_per_byte(self.K) + self.K * 16 / self.in_features

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, K={self.K}, bias={self.bias is not None}, "
                f"mode={self.mode}{self._rotation_repr()}")

    def _apply(self, fn, *args, **kwargs):
        # A move invalidates the kernel's copy of the weight (it lives on one device).
        self._restore_codes()
        self._gemv = None
        super()._apply(fn, *args, **kwargs)
        # model.float() / model.half() must not change the format: codebooks, scales, bias stay fp16.
        for name in self._FP16:
            t = getattr(self, name)
            if t is not None and t.dtype != torch.float16:
                setattr(self, name, t.half())
        return self

    _FP16 = ("codebook", "bias")  # the format's fp16 buffers

    def _build_gemv(self, device, keep_natural: bool):
        from .gemv import LutGemv

        return LutGemv(self.codebook_tensor(), device=device, keep_natural=keep_natural)

    def gemv(self):
        """The fused kernel's view of this weight, built on first use on the buffers' device."""
        if self._gemv is None:
            dev = self.codes.device
            on_gpu = dev.type == "cuda"
            release = on_gpu or self.simulate  # the simulator runs the same bookkeeping on CPU tensors
            self._gemv = self._build_gemv(dev if on_gpu else None, keep_natural=not release)
            if release:
                self._release_codes()
            self._handle = id(self)
            _LAYERS[self._handle] = self
        return self._gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"QLinear takes a torch.Tensor, got {type(x).__name__}")
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(f"QLinear expects (..., {self.in_features}) inputs, got {tuple(x.shape)}")
        if self.mode not in MODES:
            raise ValueError(f"QLinear.mode must be one of {MODES}, got {self.mode!r}")
        if not (x.is_cuda or self.simulate):
            if x.device != self.codes.device:
                raise ValueError(f"x is on {x.device} but the weight is on {self.codes.device}")
            if self.rotation is not None:
                x = self.rotator()(x)
            W = self.codebook_tensor().dequantize(x.dtype)
            return F.linear(x, W, None if self.bias is None else self.bias.to(x.dtype))
        if self.mode == "naive":
            # Seed 004's first path: the op's contract is float32, so every call casts in and out.
            dtype = x.dtype
            y = self._kernel(x.float().half())
            return y.float().to(dtype)
        if x.dtype != torch.float16:
            raise TypeError(
                f"QLinear's fast path takes float16 activations, got {x.dtype}: load the model in "
                "float16 (model.half()) or set mode='naive', which casts every call"
            )
        return self._kernel(x)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        B = x2.shape[0]
        g = self.gemv()
        if self.rotation is not None:
            x2 = qlinear_rotate(x2, self._handle)
        y = qlinear_gemv(x2, self._handle) if B <= g.max_batch else dequant_matmul(x2, g)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)


class AdditiveQLinear(QLinear):
    """A QLinear backed by an additive (AQLM-style) codebook: M codebooks of 256 vectors of 8,
    per-output scales (:class:`trapetum.additive.AdditiveTensor`); ``scheme`` is "A<M>"."""

    SHARED = ("codebooks",)  # what a layer's rows share: layers fuse (trapetum.fuse) only where these are equal

    def __init__(self, in_features: int, out_features: int, M: int = 2, bias: bool = False, device=None):
        nn.Module.__init__(self)
        from .additive import D, K, check_in_features as check_additive_in, check_M

        check_M(M)
        check_additive_in(in_features, M)
        if out_features <= 0:
            raise ValueError(f"out_features must be positive, got {out_features}")
        self.in_features, self.out_features, self.M, self.K = in_features, out_features, M, f"A{M}"
        self.register_buffer("codes", torch.zeros(out_features, in_features // D, M, dtype=torch.uint8, device=device))
        self.register_buffer("codebooks", torch.zeros(M, K, D, dtype=torch.float16, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float16, device=device) if bias else None)
        self.mode, self.simulate, self._gemv, self._codes_in_kernel = "fast", False, None, False

    @classmethod
    def from_additive(cls, t, bias: torch.Tensor | None = None) -> "AdditiveQLinear":
        t.validate()
        q = cls(t.in_features, t.out_features, t.M, bias=bias is not None, device="meta")
        q.codes, q.codebooks, q.scales = t.codes, t.codebooks, t.scales
        if t.bias is not None and bias is None:
            bias = t.bias
            q.register_buffer("bias", None)
        if bias is not None:
            q.bias = bias.detach().to(device=t.codes.device, dtype=torch.float16).clone()
        return q

    def codebook_tensor(self):
        from .additive import AdditiveTensor

        if self._codes_in_kernel:
            return self._kernel_weight()
        return AdditiveTensor(self.codes, self.codebooks, self.scales)

    def _kernel_weight(self):
        return self._gemv.t

    @property
    def bits_per_weight(self) -> float:
        return self.codebook_tensor().bits_per_weight

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, M={self.M}, bias={self.bias is not None}, "
                f"mode={self.mode}{self._rotation_repr()}")

    _FP16 = ("codebooks", "scales", "bias")

    def _build_gemv(self, device, keep_natural: bool):
        from .additive import AdditiveGemv

        # One code layout a layer (VRAM): its batch-1 plan picks the kernel family for every call.
        return AdditiveGemv(self.codebook_tensor(), device=device, single_layout=True)


class ResidualQLinear(QLinear):
    """A QLinear backed by residual vector codebooks (VPTQ-style, :class:`trapetum.residual.ResidualTensor`):
    ``codes`` holds the packed (main, residual) index words (int32), ``main`` and ``res`` the two fp16
    codebooks of 8-vectors, and ``norm_scale`` / ``norm_bias`` VPTQ's optional per-input-channel norm;
    ``K`` is "R<Nm>+<Nr>". The fused kernel is :class:`trapetum.residual.ResidualGemv` (tuned per shape on
    its first call on a GPU); the fused decode step runs such layers unfused."""

    SHARED = ("main", "res", "norm_scale", "norm_bias")  # as AdditiveQLinear.SHARED

    def __init__(self, in_features: int, out_features: int, Nm: int = 4096, Nr: int = 256, norm: bool = False,
                 bias: bool = False, device=None):
        nn.Module.__init__(self)
        from .residual import CHUNK, VECTOR_LEN, check_in_features as check_residual_in, index_bits

        bm, br = index_bits(Nm, Nr)
        check_residual_in(in_features)
        if out_features <= 0:
            raise ValueError(f"out_features must be positive, got {out_features}")
        self.in_features, self.out_features, self.Nm, self.Nr, self.K = in_features, out_features, Nm, Nr, f"R{Nm}+{Nr}"
        f16 = dict(dtype=torch.float16, device=device)
        self.register_buffer("codes", torch.zeros(out_features, in_features * (bm + br) // CHUNK, dtype=torch.int32, device=device))
        self.register_buffer("main", torch.zeros(Nm, VECTOR_LEN, **f16))
        self.register_buffer("res", torch.zeros(Nr, VECTOR_LEN, **f16))
        self.register_buffer("norm_scale", torch.ones(in_features, **f16) if norm else None)
        self.register_buffer("norm_bias", torch.zeros(in_features, **f16) if norm else None)
        self.register_buffer("bias", torch.zeros(out_features, **f16) if bias else None)
        self.mode, self.simulate, self._gemv, self._codes_in_kernel = "fast", False, None, False

    @classmethod
    def from_residual(cls, t, bias: torch.Tensor | None = None) -> "ResidualQLinear":
        t.validate()
        q = cls(t.in_features, t.out_features, t.Nm, t.Nr, norm=t.has_norm, bias=bias is not None, device="meta")
        q.codes, q.main, q.res, q.norm_scale, q.norm_bias = t.indices, t.main, t.res, t.scale, t.bias
        q._take_bias(bias)
        return q

    @property
    def norm(self) -> bool:
        return self.norm_scale is not None

    def codebook_tensor(self):
        from .residual import ResidualTensor

        if self._codes_in_kernel:
            return self._kernel_weight()
        return ResidualTensor(self.codes, self.main, self.res, self.in_features, self.out_features, self.norm_scale, self.norm_bias)

    def _kernel_weight(self):
        return self._gemv.t

    def _natural_codes(self) -> torch.Tensor:
        return self._kernel_weight().indices

    @property
    def bits_per_weight(self) -> float:
        return self.codebook_tensor().bits_per_weight

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, main={self.Nm}, residual={self.Nr}, "
                f"norm={self.norm}, bias={self.bias is not None}, mode={self.mode}{self._rotation_repr()}")

    _FP16 = ("main", "res", "norm_scale", "norm_bias", "bias")

    def _build_gemv(self, device, keep_natural: bool):
        from .residual import ResidualGemv

        return ResidualGemv(self.codebook_tensor(), device=device)


# -- schemes: which codebook format a layer has --------------------------------------------------
SCHEME_HELP = "K16, K64 or K256 (scalar codebooks), A2 or A4 (additive), R<main>+<residual> (residual, e.g. R4096+256)"


def parse_scheme(K) -> tuple[str, tuple[int, ...]]:
    """A layer's format from its ``K``: an int or "K<n>" (scalar codebooks of n entries a row), "A2" / "A4"
    (additive, M codebooks) or "R<main>+<residual>" (residual vector codebooks). Returns (kind, parameters)."""
    from .residual import index_bits

    if isinstance(K, str) and re.fullmatch(r"K\d+", K):
        K = int(K[1:])
    if isinstance(K, int) and not isinstance(K, bool):
        if K not in SUPPORTED_K:
            raise ValueError(f"K={K} is not a scalar codebook size: one of {SUPPORTED_K}")
        return "scalar", (K,)
    if isinstance(K, str):
        if K in ("A2", "A4"):
            return "additive", (int(K[1]),)
        m = re.fullmatch(r"R(\d+)\+(\d+)", K)
        if m:
            Nm, Nr = int(m[1]), int(m[2])
            index_bits(Nm, Nr)
            return "residual", (Nm, Nr)
    raise ValueError(f"unknown scheme {K!r}: one of {SCHEME_HELP}")


def check_scheme_in_features(K, in_features: int) -> None:
    """Whether a layer of ``in_features`` inputs can take scheme ``K`` (ValueError saying why not)."""
    kind, params = parse_scheme(K)
    if kind == "scalar":
        check_in_features(in_features, params[0])
    elif kind == "additive":
        from .additive import check_in_features as check_additive_in

        check_additive_in(in_features, params[0])
    else:
        from .residual import check_in_features as check_residual_in

        check_residual_in(in_features)


def empty_layer(spec: dict, device="meta") -> QLinear:
    """The QLinear subclass a saved layer spec names (K, in_features, out_features, bias; residual: norm),
    with empty buffers of its shapes, to be filled by a state dict."""
    kind, params = parse_scheme(spec["K"])
    n_in, n_out, bias = spec["in_features"], spec["out_features"], spec["bias"]
    if kind == "scalar":
        q = QLinear(n_in, n_out, params[0], bias=bias, device=device)
    elif kind == "additive":
        q = AdditiveQLinear(n_in, n_out, params[0], bias=bias, device=device)
    else:
        q = ResidualQLinear(n_in, n_out, *params, norm=spec.get("norm", False), bias=bias, device=device)
    q.rotation = spec.get("rotation")
    return q


def _quantize_linear(lin: nn.Linear, K, iters: int | None, seed: int, device, H: torch.Tensor | None = None) -> tuple[QLinear, float]:
    """``lin`` quantized to scheme ``K`` (each format's own quantizer, on ``device``; with ``H`` = E[x x^T]
    of its input, the calibration-aware one): the layer, on the weight's device, and its relative weight MSE."""
    kind, params = parse_scheme(K)
    if kind == "scalar":
        imp = None if H is None else torch.diagonal(H).clamp_min(0)  # activation-aware k-means: E[x_i^2] per column
        q, rep = QLinear.from_linear(lin, K=params[0], iters=25 if iters is None else iters, seed=seed, device=device,
                                     importance=imp)
        return q, rep.rel_mse
    return _quantize_group([lin], K, iters, seed, device, H)[0]


def _quantize_group(lins: list[nn.Linear], K, iters: int | None, seed: int, device, H: torch.Tensor | None = None
                    ) -> list[tuple[QLinear, float]]:
    """Vector-codebook layers that read the same input (a layer's q/k/v, its gate/up) quantized as one
    weight, their rows stacked: one codebook set for the group, which :mod:`trapetum.fuse` needs to fuse
    them; with ``H`` (their input's E[x x^T]) to the calibration-aware objective. Returns each part's layer
    (on its weight's device) and relative weight MSE."""
    kind, params = parse_scheme(K)
    dev = lins[0].weight.device
    W = torch.cat([lin.weight.detach().float() for lin in lins]).to(device or dev)
    kw = dict(seed=seed, progress=False, H=None if H is None else H.float().to(W.device)) | ({} if iters is None else {"iters": iters})
    if kind == "additive":
        from .additive import AdditiveTensor, quantize_additive

        t, rep = quantize_additive(W, M=params[0], **kw)
        t = t.to(dev)
        rows = lambda r0, r1, b: AdditiveQLinear.from_additive(AdditiveTensor(t.codes[r0:r1], t.codebooks, t.scales[r0:r1]), b)
    elif kind == "residual":
        from .residual import ResidualTensor, quantize_residual

        t, rep = quantize_residual(W, *params, **kw)
        t = t.to(dev)
        rows = lambda r0, r1, b: ResidualQLinear.from_residual(
            ResidualTensor(t.indices[r0:r1], t.main, t.res, t.in_features, r1 - r0, t.scale, t.bias), b)
    else:
        raise ValueError(f"scheme {K!r}: only vector codebooks (additive, residual) are quantized as a group")
    if len(lins) == 1:
        return [(rows(0, lins[0].out_features, lins[0].bias), rep.rel_mse)]
    out, r0 = [], 0
    for lin in lins:
        q = rows(r0, r0 + lin.out_features, lin.bias)
        w = lin.weight.detach().float()
        out.append((q, float((q.dequantize(torch.float32).to(w.device) - w).pow(2).sum() / w.pow(2).sum().clamp_min(1e-30))))
        r0 += lin.out_features
    return out


class QEmbedding(nn.Module):
    """``nn.Embedding`` with scalar codebook rows: a token's row is its own K-entry fp16 codebook and
    packed codes (a :class:`CodebookTensor` of (vocab, dim)), and a lookup decodes only the rows it
    reads. At 7B the fp16 embedding is 0.26 GB, 6 % of a 4-bit model with a 4-bit LM head.
    Built as :class:`QLinear` is: empty buffers of a shape here, filled by :meth:`from_codebook` or a
    state dict."""

    def __init__(self, num_embeddings: int, embedding_dim: int, K: int = 16, padding_idx: int | None = None, device=None):
        super().__init__()
        packing_for(K)
        check_in_features(embedding_dim, K)
        self.K, self.num_embeddings, self.embedding_dim, self.padding_idx = K, num_embeddings, embedding_dim, padding_idx
        self.register_buffer("codes", torch.zeros(num_embeddings, embedding_dim // codes_per_byte(K), dtype=torch.uint8, device=device))
        self.register_buffer("codebook", torch.zeros(num_embeddings, K, dtype=torch.float16, device=device))

    @classmethod
    def from_codebook(cls, ct: CodebookTensor, padding_idx: int | None = None) -> "QEmbedding":
        ct.validate()
        q = cls(ct.out_features, ct.in_features, ct.K, padding_idx, device="meta")
        q.codes, q.codebook = ct.codes, ct.codebook
        return q

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, K: int = 16, iters: int = 25, seed: int = 0, device=None):
        """Per-row k-means of ``emb.weight`` (:func:`trapetum.codebook.quantize`); returns (QEmbedding, report)."""
        ct, rep = _kmeans_weight(emb, nn.Embedding, K, iters, seed, device)
        return cls.from_codebook(ct, emb.padding_idx), rep

    def spec(self) -> dict:
        """What the saved format records of this layer."""
        return {"K": self.K, "num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim, "padding_idx": self.padding_idx}

    def codebook_tensor(self) -> CodebookTensor:
        """The table as a CodebookTensor (validated: dtypes, shapes, finite codebooks, code range)."""
        ct = CodebookTensor(self.codes, self.codebook.half(), self.K, self.embedding_dim, self.num_embeddings)
        ct.validate()
        return ct

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"token ids must be an int32 or int64 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.device != self.codes.device:
            raise ValueError(f"token ids are on {ids.device}, the embedding on {self.codes.device}")
        # CodebookTensor.dequantize's gather, without a CodebookTensor: its checks do not belong in a decode step
        flat = ids.reshape(-1)
        q = unpack_codes(self.codes[flat], self.K).long()
        return self.codebook[flat].gather(1, q).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, K={self.K}"


def layer_spec(q: QLinear) -> dict:
    """What the saved format records of a quantized layer: its scheme K, shape, bias (and a residual one's norm)."""
    spec = {"K": q.K, "in_features": q.in_features, "out_features": q.out_features, "bias": q.bias is not None}
    if isinstance(q, ResidualQLinear):
        spec["norm"] = q.norm
    if q.rotation is not None:
        spec["rotation"] = q.rotation
    return spec


def qlinears(model: nn.Module) -> dict[str, QLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QLinear)}


def set_mode(model: nn.Module, mode: str) -> None:
    """Every QLinear of ``model`` to "fast" (fp16 end to end) or "naive" (per-call fp32 casts)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for m in qlinears(model).values():
        m.mode = mode


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_model(model, K: int | str = 16, exclude=(), min_features: int = 0, iters: int | None = None, seed: int = 0,
                   device=None, progress: bool = True, embedding: bool = False, joint: bool = False,
                   calib: torch.Tensor | None = None, batch_size: int = 8, finetune: int | dict | None = None,
                   rotate: bool | str = False) -> dict:
    """Replace every decoder projection (nn.Linear in model.model.layers) by a QLinear, in place.

    ``K`` is the scheme (:func:`parse_scheme`): 16, 64, 256 (or "K16"...) for scalar codebooks (a
    :class:`QLinear`), "A2" / "A4" for additive ones (:class:`AdditiveQLinear`, AQLM-style, 2 or 4
    bits), "R<main>+<residual>" for residual vector codebooks (:class:`ResidualQLinear`, VPTQ-style).
    Without ``calib`` each format's quantizer minimises the plain weight error. ``calib`` (LongTensor
    [n_samples, seq_len] of token ids, never the evaluation text; see
    :func:`trapetum.pipelines.generated_calibration_ids`) makes it calibration-aware, as the accuracy
    chapter's pipelines are: the decoder layers are quantized in order, each on the inputs the layers
    before it, already quantized, give (``batch_size`` samples a forward), with each projection's input
    statistics H = E[x x^T]: activation-aware k-means (importance E[x_i^2]; the chapter's "kmeans-act")
    for scalar codebooks, the H-weighted objectives of the additive and residual quantizers.
    ``iters``: the quantizer's iterations (default: each quantizer's own; 25 for scalar k-means).

    ``exclude``: glob patterns on full module names (e.g. ``"*.down_proj"``, ``"model.layers.0.*"``)
    kept as nn.Linear; ``min_features``: layers whose smaller side is below it stay nn.Linear too
    (seed 004 applies the kernel only to large layers: small ones are launch-bound). Layers whose
    in_features the packing cannot take are kept and reported. lm_head always stays; the token
    embedding too unless ``embedding`` (then a :class:`QEmbedding` with the same K; on a model whose
    lm_head shares the embedding's weight, the head keeps that weight in fp16 and the tie ends).
    ``device``: where k-means runs (default: the weight's device). ``joint``: each layer's q/k/v, and
    its gate/up, quantized as one weight a group (rows stacked, one codebook set) where all of a group
    is quantized, so that additive and residual layers fuse afterwards (:mod:`trapetum.fuse`: layers
    with separate codebooks do not); scalar codebooks are per row and fuse either way.
    ``finetune`` (scalar and additive codebooks, with ``calib``): afterwards, train every codebook
    entry (and the additive layers' scales) and the RMSNorm weights, codes fixed, so that the quantized
    model's next-token distribution matches the unquantized one's on ``calib`` (KL distillation,
    :func:`trapetum.finetune.finetune`; the accuracy chapter's "kmeans-act" and "additive" with
    ``ft_epochs``); a joint group keeps one codebook set. The number of epochs, or a dict of ``epochs``,
    ``lr`` (default :data:`FINETUNE_LR` of the format), ``batch`` and ``norms``. It keeps a frozen copy of the unquantized model while it runs
    and trains in float32 (an fp16 model is cast up and back), so it needs about three times the
    model's fp16 bytes of memory, and activations. Returns the quantization summary, also kept as
    ``model.trapetum_quant`` (what save_quantized writes); with ``finetune`` its "finetune" entry
    holds the options and the :class:`~trapetum.finetune.FinetuneReport`.
    ``rotate``: every quantized layer is fitted as W U^T (U the served randomized Hadamard rotation of its
    inputs, :class:`trapetum.hadamard.Rotation` of ``seed``; H as U H U^T) and computes U x before its kernel
    (QuIP#'s incoherence processing on the inputs only, the accuracy chapter's ``outputs=false``): one more
    launch a projection group (a layer's q/k/v and its gate/up share theirs once fused).
    ``rotate="stream"``: the model's residual stream is rotated first (:func:`trapetum.hadamard.rotate_residual`:
    the norms' weights folded into the layers, QuaRot's construction), so that every layer's codes are fitted
    to rotated inputs while only down_proj rotates at run time: one launch a layer. It rewrites the embedding,
    the LM head (untied) and the norms too, into the same function.
    """
    import copy

    from tqdm.auto import tqdm

    from .pipelines import decoder_linears

    kind, params = parse_scheme(K)
    K = params[0] if kind == "scalar" else K
    if rotate not in (False, True, "stream"):
        raise ValueError(f"rotate is False, True or 'stream', got {rotate!r}")
    if embedding and kind != "scalar":
        raise ValueError(f"a quantized embedding takes scalar codebooks (K16, K64, K256), not {K!r}")
    if isinstance(exclude, str):
        exclude = (exclude,)
    ft = _finetune_options(finetune, kind, K, calib)
    from .hadamard import rotate_residual, rotates_at_run_time

    stream = rotate_residual(model, seed) if rotate == "stream" else None
    teacher = copy.deepcopy(model).eval() if ft else None
    linears = decoder_linears(model)
    layers, excluded, rel_mse = {}, {}, {}
    for name, lin in linears.items():
        if any(fnmatch.fnmatchcase(name, p) for p in exclude):
            excluded[name] = "excluded by pattern"
        elif min(lin.in_features, lin.out_features) < min_features:
            excluded[name] = f"smaller than min_features={min_features}"
        else:
            try:
                check_scheme_in_features(K, lin.in_features)
            except ValueError as e:
                excluded[name] = str(e)
    todo = [n for n in linears if n not in excluded]
    joint = joint and kind != "scalar"

    def run(names, H=None):
        lins = [linears[n] for n in names]
        rot = rotates_at_run_time(names[0], rotate)
        if rot:
            lins, H = _rotated(lins, H, seed)
        done = (_quantize_group(lins, K, iters, seed, device, H) if len(names) > 1
                else [_quantize_linear(lins[0], K, iters, seed, device, H)])
        for name, (q, rel_mse[name]) in zip(names, done):
            if rot:
                q.rotation = seed
            _set_submodule(model, name, q)
            layers[name] = layer_spec(q)
        bar.update(len(names))

    with tqdm(total=len(todo), desc=f"quantize K={K}" + (" (calibrated)" if calib is not None else ""), disable=not progress) as bar:
        if calib is None:
            for names in _quantize_units(todo, linears, joint):
                run(names)
        else:
            _calibrated(model, calib, batch_size, todo, linears, joint, run)
    embeddings = {}
    if embedding:
        emb = model.get_input_embeddings()
        name = next(n for n, mod in model.named_modules() if mod is emb)
        q, rep = QEmbedding.from_embedding(emb, K=K, iters=25 if iters is None else iters, seed=seed, device=device)
        _set_submodule(model, name, q)
        embeddings[name] = q.spec()
        rel_mse[name] = rep.rel_mse
    summary = {"K": K, "layers": layers, "excluded": excluded, "embeddings": embeddings, "joint": joint,
               "calibration_tokens": 0 if calib is None else int(calib.numel()), "rotate": rotate}
    if stream:
        summary["stream_rotation"] = stream
    if ft:
        summary["finetune"] = {**ft, **_finetune_codebooks(model, teacher, calib, list(layers), ft, progress).as_dict()}
        del teacher
    model.trapetum_quant = summary
    return {**summary, "rel_mse": rel_mse}


def _rotated(lins: list[nn.Linear], H: torch.Tensor | None, seed: int) -> tuple[list[nn.Linear], torch.Tensor | None]:
    """``lins`` (one input) as the layers their rotated codes are fitted to, W U^T in fp32, and H as U H U^T."""
    from .hadamard import Rotation

    n = lins[0].in_features
    U = Rotation(n, seed).matrix(torch.float32).to(lins[0].weight.device)
    out = []
    for lin in lins:
        r = nn.Linear(n, lin.out_features, bias=lin.bias is not None, device="meta")
        r.weight = nn.Parameter(lin.weight.detach().float() @ U.T, requires_grad=False)
        if lin.bias is not None:
            r.bias = nn.Parameter(lin.bias.detach(), requires_grad=False)
        out.append(r)
    return out, None if H is None else U.to(H.device) @ H.float() @ U.T.to(H.device)


FINETUNE_DEFAULTS = dict(lr=None, batch=8, norms=True)  # quantize_model's finetune (see trapetum.finetune.finetune)
# The formats quantize_model can fine-tune, each with the relative step size that did best on SmolLM2 (NOTES:
# accuracy run i for scalar, run d for additive codebooks)
FINETUNE_LR = {"scalar": 1e-3, "additive": 3e-3}


def _finetune_options(finetune, kind: str, K, calib) -> dict | None:
    """quantize_model's ``finetune`` as finetune()'s keywords, or None; ValueError before any work is done."""
    if finetune is None or finetune is False or finetune == 0:
        return None
    opts = {"epochs": finetune} if isinstance(finetune, int) and not isinstance(finetune, bool) else finetune
    if not isinstance(opts, dict) or set(opts) - {"epochs", *FINETUNE_DEFAULTS}:
        raise ValueError(f"finetune is a number of epochs or a dict of epochs, {', '.join(FINETUNE_DEFAULTS)}; got {finetune!r}")
    opts = {**FINETUNE_DEFAULTS, **opts}
    if opts["lr"] is None:
        opts["lr"] = FINETUNE_LR.get(kind)
    if not isinstance(opts.get("epochs"), int) or isinstance(opts["epochs"], bool) or opts["epochs"] < 1:
        raise ValueError(f"finetune needs epochs >= 1, got {opts.get('epochs')!r}")
    if kind not in FINETUNE_LR:
        raise ValueError(f"finetune trains scalar (K16, K64, K256) and additive (A2, A4) codebooks; {K!r} layers are not supported yet")
    if calib is None:
        raise ValueError("finetune needs calib: the tokens on which the quantized model learns to match the unquantized one")
    return opts


def _as_stored(codes: torch.Tensor) -> torch.Tensor:
    """The decode of a layer fine-tuning leaves alone (kept as nn.Linear): its weight is its "codes"."""
    return codes


def _trainable(q, pool: list):
    """(the :class:`~trapetum.pipelines.Form` of QLinear or AdditiveQLinear ``q``: its codes and its stored
    parameters in fp32, the layer built back from a form). Codebooks equal to one already in ``pool`` (a joint
    group's one set) are that same tensor, so fine-tuning trains them as one."""
    form, build = _trainable_stored(q, pool)
    if q.rotation is None:
        return form, build
    import functools

    from .pipelines import Form, _rotated_decode

    U, seed = q.rotator().matrix(torch.float32).to(form.codes.device), q.rotation

    def rebuild(f):
        new = build(f)
        new.rotation = seed
        return new

    return Form(form.codes, form.params, functools.partial(_rotated_decode, decode=form.decode, U=U, V=None)), rebuild


def _trainable_stored(q, pool: list):
    """:func:`_trainable` of the weight as stored (for a rotated layer, in the rotated basis)."""
    from .pipelines import Form, _additive_decode, _codebook_decode

    bias = q.bias
    if isinstance(q, AdditiveQLinear):
        from .additive import AdditiveTensor

        t = q.codebook_tensor()
        books = t.codebooks.float()
        same = next((b for b in pool if b.shape == books.shape and b.device == books.device and torch.equal(b, books)), None)
        if same is None:
            pool.append(books)
        books = books if same is None else same
        return (Form(t.codes, {"codebooks": books, "scales": t.scales.float()}, _additive_decode),
                lambda f: AdditiveQLinear.from_additive(AdditiveTensor(t.codes, f.params["codebooks"].to(t.codebooks), f.params["scales"].to(t.scales)), bias))
    ct = q.codebook_tensor()
    return (Form(unpack_codes(ct.codes, ct.K), {"cb": ct.codebook.float()}, _codebook_decode),
            lambda f: QLinear.from_codebook(CodebookTensor(ct.codes, f.params["cb"].to(ct.codebook), ct.K, ct.in_features, ct.out_features), bias))


def _finetune_codebooks(model, teacher, calib: torch.Tensor, names: list[str], opts: dict, progress: bool):
    """Train the codebooks (and scales) of the quantized layers ``names``, and the norms if ``opts`` say so, by
    distillation from ``teacher``, codes fixed: while it trains each layer is an nn.Linear whose weight is decoded
    from its codes and stored parameters (a :class:`~trapetum.pipelines.Form`), then the same kind of layer again
    with the trained parameters, rounded to fp16. Returns the FinetuneReport."""
    from .finetune import finetune as run
    from .pipelines import Form, decoder_linears

    dtype = next(model.parameters()).dtype
    forms, built, pool = {}, {}, []
    for name in names:
        q = model.get_submodule(name)
        forms[name], built[name] = _trainable(q, pool)
        lin = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None, device=forms[name].codes.device, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(forms[name].W_hat())
            if q.bias is not None:
                lin.bias.copy_(q.bias)
        _set_submodule(model, name, lin)
    for name, lin in decoder_linears(model).items():
        forms.setdefault(name, Form(lin.weight.detach(), {}, _as_stored))
    # fp32 while training (Adam's steps on fp16 norm weights would round away), every tensor's own dtype after
    # (module.float() casts parameters in place but replaces buffers, so they are named by module and key)
    kept = {(id(mod), k): t.dtype for mod in model.modules() for k, t in [*mod._parameters.items(), *mod._buffers.items()]
            if t is not None and t.is_floating_point()}
    try:
        nn.Module.float(model)  # transformers' own float() refuses models loaded from GGUF; the teacher only gives logits
        report = run(model, teacher, forms, calib, epochs=opts["epochs"], lr=opts["lr"], batch=opts["batch"],
                     norms=opts["norms"], progress=progress)
    finally:
        for mod in model.modules():
            for k, t in mod._parameters.items():
                if t is not None and kept.get((id(mod), k), t.dtype) != t.dtype:
                    t.data = t.data.to(kept[id(mod), k])
            for k, t in mod._buffers.items():
                if t is not None and kept.get((id(mod), k), t.dtype) != t.dtype:
                    mod._buffers[k] = t.to(kept[id(mod), k])
        for name, rebuild in built.items():  # trained or not (an error), every layer is a quantized one again
            _set_submodule(model, name, rebuild(forms[name]))
    return report


@torch.no_grad()
def _calibrated(model, calib: torch.Tensor, batch_size: int, todo: list[str], linears: dict, joint: bool, run) -> None:
    """Quantize ``todo`` layer by layer (``run(names, H)``), each decoder layer's projections with the input
    statistics that the calibration tokens give them after every earlier layer is quantized (GPTQ's order)."""
    from .pipelines import _layer_inputs, _run_layer, _SecondMoments, decoder_layers

    if not isinstance(calib, torch.Tensor) or calib.dim() != 2 or calib.numel() == 0 or calib.dtype not in (torch.int32, torch.int64):
        raise ValueError("calib must be a non-empty LongTensor [n_samples, seq_len] of token ids, got "
                         + (f"{calib.dtype} of shape {tuple(calib.shape)}" if isinstance(calib, torch.Tensor) else type(calib).__name__))
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    layers = decoder_layers(model)
    inputs = _layer_inputs(model, layers, calib, batch_size)
    for i, layer in enumerate(layers):
        mine = [n for n in todo if n.startswith(f"model.layers.{i}.")]
        if mine:
            stats = _SecondMoments({n: linears[n] for n in mine})
            try:
                _run_layer(layer, inputs)
            finally:
                stats.remove()
            for names in _quantize_units(mine, linears, joint):
                run(names, stats.H(names[0]))  # a group's parts read one input: one H
        inputs = _run_layer(layer, inputs)  # the next layer sees this one quantized


def _quantize_units(names: list[str], linears: dict, joint: bool) -> list[tuple[str, ...]]:
    """The order layers are quantized in: one name at a time, or with ``joint`` a fusable group's
    names together (:data:`trapetum.fuse.GROUPS`, all of it quantized, one input size, all with a
    bias or none)."""
    if not joint:
        return [(n,) for n in names]
    from .fuse import GROUPS

    todo, units = set(names), []
    for n in names:
        if n not in todo:
            continue
        parent, _, child = n.rpartition(".")
        group = next((tuple(f"{parent}.{c}" for c in g) for g in GROUPS.values() if g[0] == child), (n,))
        lins = [linears.get(m) for m in group]
        if (len(group) == 1 or not all(m in todo for m in group) or len({lin.in_features for lin in lins}) != 1
                or len({lin.bias is None for lin in lins}) != 1):
            group = (n,)
        units.append(group)
        todo -= set(group)
    return units


# -- save / load ---------------------------------------------------------------------------------
def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def save_quantized(model, folder: str | Path, tokenizer=None) -> Path:
    """Write ``folder/model.safetensors`` and ``folder/trapetum.json`` (and the tokenizer, if given)."""
    from safetensors.torch import save_file

    from .fuse import is_fused

    if is_fused(model):
        raise ValueError("this model's projections are fused (trapetum.fuse.fuse_projections): the saved format keeps "
                         "transformers' layer names, so save the model before fusing and fuse after loading")
    summary = getattr(model, "trapetum_quant", None)
    found = qlinears(model)
    if summary is None or not found:
        raise ValueError("this model has no QLinear layers: call trapetum.qlinear.quantize_model first")
    if set(found) != set(summary["layers"]):
        raise ValueError(f"model.trapetum_quant lists {sorted(summary['layers'])} but the model's QLinears are {sorted(found)}")
    embeddings = {n: m for n, m in model.named_modules() if isinstance(m, QEmbedding)}
    for name, q in found.items():
        if summary["layers"][name] != layer_spec(q):
            raise ValueError(f"model.trapetum_quant says {name} is {summary['layers'][name]}, the layer is {layer_spec(q)}")
    for q in list(found.values()) + list(embeddings.values()):
        q.codebook_tensor()  # refuse to write an invalid layer
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, tied, owner = {}, {}, {}
    for name, t in model.state_dict(keep_vars=False).items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape))
        if t.numel() and key in owner:  # tied weights (lm_head = embed_tokens): stored once
            tied[name] = owner[key]
            continue
        owner[key] = name
        tensors[name] = t.detach().cpu().contiguous()
    header = {
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "model_class": type(model).__name__,
        "base_config": model.config.to_dict(),
        "K": summary["K"],
        "layers": summary["layers"],
        "excluded": summary["excluded"],
        "embeddings": {n: q.spec() for n, q in embeddings.items()},
        # how the layers were made (not needed to load them): calibration and fine-tuning, if any
        "calibration_tokens": int(summary.get("calibration_tokens", 0)),
        "finetune": summary.get("finetune"),
        "tied": tied,
        "tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "sha256": _sha(t)} for n, t in tensors.items()},
    }
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"trapetum": json.dumps({"format_version": FORMAT_VERSION, "kind": KIND})})
    (folder / CONFIG_FILE).write_text(json.dumps(header, indent=1, default=str) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def is_quantized_folder(path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def read_config(folder: str | Path) -> dict:
    """trapetum.json of a saved model, checked for version, kind and the fields load needs."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {folder}: not a model saved by trapetum.qlinear.save_quantized")
    try:
        h = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QuantizedModelError(f"{path}: not readable JSON (truncated or corrupt?): {e}") from e
    if not isinstance(h, dict):
        raise QuantizedModelError(f"{path}: expected a JSON object")
    if h.get("format_version") != FORMAT_VERSION:
        raise QuantizedModelError(f"{path}: format_version {h.get('format_version')!r}, this trapetum reads {FORMAT_VERSION}")
    if h.get("kind") != KIND:
        raise QuantizedModelError(f"{path}: kind {h.get('kind')!r} is not {KIND!r}")
    for key, typ in (("base_config", dict), ("layers", dict), ("excluded", dict), ("tied", dict), ("tensors", dict)):
        if not isinstance(h.get(key), typ):
            raise QuantizedModelError(f"{path}: field {key!r} missing or not a {typ.__name__}")
    if not isinstance(h.setdefault("embeddings", {}), dict):  # files written before QEmbedding have none
        raise QuantizedModelError(f"{path}: field 'embeddings' is not a dict")
    for name, spec in h["embeddings"].items():
        try:
            K, n, dim = int(spec["K"]), int(spec["num_embeddings"]), int(spec["embedding_dim"])
            pad = spec["padding_idx"]
        except (KeyError, TypeError, ValueError) as e:
            raise QuantizedModelError(f"{path}: embedding {name} lacks K/num_embeddings/embedding_dim/padding_idx: {e}") from e
        if K not in SUPPORTED_K:
            raise QuantizedModelError(f"{path}: embedding {name} has K={K}, not one of {SUPPORTED_K}")
        if pad is not None and not (isinstance(pad, int) and 0 <= pad < n):
            raise QuantizedModelError(f"{path}: embedding {name} has padding_idx {pad!r}, not a row of {n}")
        try:
            check_in_features(dim, K)
        except ValueError as e:
            raise QuantizedModelError(f"{path}: embedding {name}: {e}") from e
    for name, spec in h["layers"].items():
        try:
            K, n_in, n_out = spec["K"], int(spec["in_features"]), int(spec["out_features"])
            bool(spec["bias"])
        except (KeyError, TypeError, ValueError) as e:
            raise QuantizedModelError(f"{path}: layer {name} lacks K/in_features/out_features/bias: {e}") from e
        try:
            kind, _ = parse_scheme(K)
            check_scheme_in_features(K, n_in)
        except ValueError as e:
            raise QuantizedModelError(f"{path}: layer {name}: {e}") from e
        if not isinstance(spec.get("norm", False), bool) or ("norm" in spec and kind != "residual"):
            raise QuantizedModelError(f"{path}: layer {name}: 'norm' is a residual layer's true/false, got {spec.get('norm')!r}")
        rot = spec.get("rotation")
        if rot is not None and (not isinstance(rot, int) or isinstance(rot, bool) or rot < 0 or n_in % 2):
            raise QuantizedModelError(f"{path}: layer {name}: 'rotation' is a non-negative integer seed of a layer with an even "
                                      f"number of inputs, got {rot!r} at in_features={n_in}")
    return h


def load_quantized(folder: str | Path, device="cpu", dtype: torch.dtype | None = None):
    """The model saved by :func:`save_quantized`, in eval mode, every tensor checked against its SHA-256.

    ``dtype`` casts the floating-point tensors that are not codebook buffers (embeddings, norms,
    excluded linears); codebooks stay fp16, codes uint8.
    """
    from safetensors import SafetensorError
    from safetensors.torch import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    h = read_config(folder)
    wpath = folder / WEIGHTS_FILE
    if not wpath.is_file():
        raise FileNotFoundError(f"{wpath} is missing")
    try:
        with safe_open(str(wpath), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise QuantizedModelError(f"{wpath}: not a readable safetensors file (truncated or corrupt?): {e}") from e
    if set(tensors) != set(h["tensors"]):
        missing, extra = sorted(set(h["tensors"]) - set(tensors)), sorted(set(tensors) - set(h["tensors"]))
        raise QuantizedModelError(f"{wpath}: tensors do not match {CONFIG_FILE}: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in tensors.items():
        spec = h["tensors"][name]
        if list(t.shape) != spec.get("shape") or str(t.dtype).removeprefix("torch.") != spec.get("dtype"):
            raise QuantizedModelError(f"{wpath}: {name} is {str(t.dtype)} {list(t.shape)}, {CONFIG_FILE} says {spec.get('dtype')} {spec.get('shape')}")
        if _sha(t) != spec.get("sha256"):
            raise QuantizedModelError(f"{wpath}: {name} bytes do not match the SHA-256 in {CONFIG_FILE} (file tampered or corrupt)")
    base = dict(h["base_config"])
    try:
        config = AutoConfig.for_model(**base)
    except (ValueError, KeyError, TypeError) as e:
        raise QuantizedModelError(f"{folder}: base_config is not a transformers config: {e}") from e
    # Build the skeleton without allocating or initialising weights: the file provides them.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if type(model).__name__ != h.get("model_class"):
        raise QuantizedModelError(f"{folder}: config builds {type(model).__name__}, the file was saved from {h.get('model_class')}")
    def swap_in(what, name, spec, cls, shape, want, new):
        # the base config's module must be the fp16 kind of the saved one (``cls``), of the saved shape
        try:
            old = model.get_submodule(name)
        except AttributeError as e:
            raise QuantizedModelError(f"{folder}: quantized {what} {name} does not exist in {type(model).__name__}") from e
        if not isinstance(old, cls) or shape(old) != want:
            raise QuantizedModelError(f"{folder}: {what} {name} is {old} in the base config, the file says {spec}")
        _set_submodule(model, name, new)

    for name, sp in h["layers"].items():
        swap_in("layer", name, sp, nn.Linear, lambda m: (m.in_features, m.out_features), (sp["in_features"], sp["out_features"]),
                empty_layer(sp, device="meta"))
    for name, sp in h["embeddings"].items():
        swap_in("embedding", name, sp, nn.Embedding, lambda m: (m.num_embeddings, m.embedding_dim), (sp["num_embeddings"], sp["embedding_dim"]),
                QEmbedding(sp["num_embeddings"], sp["embedding_dim"], sp["K"], sp["padding_idx"], device="meta"))
    state = dict(tensors)
    for alias, src in h["tied"].items():
        if src not in state:
            raise QuantizedModelError(f"{folder}: tied tensor {alias} points to {src}, which is not in the file")
        state[alias] = state[src]
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise QuantizedModelError(f"{folder}: the saved tensors do not fit the model: {e}") from e
    for alias, src in h["tied"].items():  # share storage again, as the saved model did
        mod, _, attr = alias.rpartition(".")
        smod, _, sattr = src.rpartition(".")
        setattr(model.get_submodule(mod), attr, getattr(model.get_submodule(smod), sattr))
    _rebuild_non_persistent(model, config)
    for name, q in list(qlinears(model).items()) + [(n, model.get_submodule(n)) for n in h["embeddings"]]:
        try:
            q.codebook_tensor()
        except (CodebookFormatError, ValueError) as e:
            raise QuantizedModelError(f"{folder}: layer {name}: {e}") from e
    if dtype is not None:
        for m in model.modules():
            if isinstance(m, QLinear):
                continue
            for p in m.parameters(recurse=False):
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
    model.trapetum_quant = {"K": h.get("K"), "layers": h["layers"], "excluded": h["excluded"], "embeddings": h["embeddings"],
                            "calibration_tokens": h.get("calibration_tokens", 0)}  # files before session 43 have neither
    if h.get("finetune"):
        model.trapetum_quant["finetune"] = h["finetune"]
    return model.to(device).eval()


def _rebuild_non_persistent(model, config) -> None:
    """Buffers not in a state dict (rotary inv_freq) are still on meta: recompute them by re-creating their module."""
    for name, mod in list(model.named_modules()):
        if any(b is not None and b.is_meta for b in mod.buffers(recurse=False)):
            try:
                with torch.device("cpu"):  # __init__ computes them (its device argument differs across versions)
                    fresh = type(mod)(config=config)
            except TypeError as e:
                raise QuantizedModelError(f"cannot rebuild {name} ({type(mod).__name__}), whose buffers are not saved: {e}") from e
            _set_submodule(model, name, fresh)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise QuantizedModelError(f"tensors not restored from the file: {left[:5]}")
