"""Residual vector codebooks (VPTQ-style): W[o, 8g:8g+8] = main[im[o, g]] + res[ir[o, g]].

Format (:class:`ResidualTensor`):

* vectors of v = 8 consecutive input weights of one output row;
* one fp16 main codebook (Nm, 8), Nm in {4096, 8192}, and one fp16 residual codebook (Nr, 8),
  Nr in {256, 512}, shared by the whole layer;
* per vector one b-bit field f = im | ir << log2(Nm) (main index in the low bits, as VPTQ packs
  them), b = log2(Nm) + log2(Nr) in {20, 21, 22}; a row's fields form an LSB-first bit stream
  in int32 words, so a row of ``in`` weights is ``in * b / 256`` words: exactly b / 8 bits a
  weight plus the codebooks (2.5 bits for 4096/256);
* optional per-input-channel fp16 ``scale`` and ``bias``, applied as VPTQ's ``enable_norm``:
  W = W_hat * scale[col] + bias[col].  The GEMV scales x first and adds dot(bias, x) to every output.

Every 32 vectors (256 input weights, a "chunk") fill exactly b words, so in_features must be a
multiple of 256: the field of vector i of a chunk sits at the constant bit offset i * b.

The fused GEMV (:class:`ResidualGemv`), "a lane owns a row" like :func:`trapetum.gemv.lut_kernel`:

* the words are tiled at init as [row-block][chunk][word][lane]: a warp's load of word w of one
  chunk for its 32 rows is 128 contiguous bytes;
* each warp of a block owns RB row-blocks and streams every chunk of the block's K-slice (a ring
  of two chunks in registers: one in use, one in flight); a chunk's 32 fields are extracted at
  compile-time-constant bit offsets (the chunk body is generated, one call a vector);
* the main codebook is read with one 16-byte load a lookup, from shared memory (staged by the
  block, 64/128 KiB: needs the opt-in above 48 KiB) or through L1 from global memory (no
  prologue) -- the ``main`` plan knob; the residual codebook (4/8 KiB) is always in shared;
* the block's slice of x sits in shared memory as fp32 (scaled when the layer has a norm), read
  as 16-byte broadcasts that serve RB rows;
* K-slices of different blocks meet in an fp32 workspace summed by the last block to finish (an
  atomic counter it resets, so the launch replays in a CUDA graph).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import warnings

import torch

from .codebook import ROW_BLOCK, CodebookFormatError, check_rows, read_layer_file
from .gemv import (FP16_HEADROOM, INLINE, SIM, _as_kernel_array, async_wait_all, check_activation, check_output, codebook_exponent,
                   copy16_async, float2_to_half2, fp16_table_scale, global_timer_lo, hadd2_to_float2, half2_abs_bits, half2_to_float2,
                   kernel_device, load16, load_byte_offset, load_half_byte_offset, max_shared_bytes, mma_m16n8k8, mma_table_tile,
                   sload4, sm_count, sm_id, store_byte_offset, tuning_enabled, tuning_inputs, with_shared_limit)
from .kmeans import check_finite
from .tuning import PlanCache

from numba import cuda, float32, int32, uint32  # noqa: E402  (gemv set numba's environment first)

FORMAT_VERSION = 1
KIND = "residual-vector-codebook"
VECTOR_LEN = 8
CHUNK = 256  # input weights a chunk: 32 vectors, b words
VECS_PER_CHUNK = CHUNK // VECTOR_LEN
SUPPORTED_MAIN = (4096, 8192)
SUPPORTED_RES = (256, 512)
OPTIN_SIM = 227 * 1024  # the simulator plans as if it had an H100's opt-in shared memory
STATIC_LIMIT = 48 * 1024
TOLERANCE = 2e-3  # as bench.TOLERANCE (bench imports this module, so the value is repeated)
STAMPS = 6  # a block's timeline words (see residual_table_kernel)
TABLE_STEPS = (1, 2, 4, 8)  # groups (vectors) a table step of the table kernel: it must divide a chunk's 32
# 16-byte loads a thread a round of the table kernel's K-split finish (see _common_device_functions). 16 ran
# 0.3-1 us slower than 8 on the H200 (data/_runs/residual-rb-probe-3b759ff-h200.json), but there a round's
# loads still went out one after another (fixed in a1128cf); 16 with the loads issued together is untimed.
FINISH_LOADS = 8
# K-slices a level-one sum of the table kernel's two-level finish (see _common_device_functions); 0: one level.
# A plan's ``fanin``; the tuner also times FINISH_FANIN where a plan has more than 8 K-slices.
FINISH_FANIN = 4


def _finish_runs(nsplit, fanin):
    """Level-one sums of the table kernel's finish for ``nsplit`` K-slices in runs of ``fanin`` (0: one level)."""
    return (nsplit + fanin - 1) // fanin if 0 < fanin < nsplit else 0


def _finish_counters(groups, nsplit, fanin, spread):
    """Counters of a table-kernel launch's finish: one a row-group, then one a row-group's run of ``fanin``
    K-slices, or under ``spread`` a second one a row-group (its blocks counting out). The kernel's timeline
    stamps follow them."""
    return groups * (1 + _finish_runs(nsplit, fanin) + (1 if spread else 0))


def finish_sizes(ksplit: int, groups: int, fanin: int = 0, spread: bool = False) -> tuple[int, int]:
    """(slices of ws, counters) a table-kernel launch needs: the K-slices' partials and the level-one
    sums' slots, and :func:`_finish_counters`."""
    return ksplit + _finish_runs(ksplit, fanin), _finish_counters(groups, ksplit, fanin, spread)


finish_runs = cuda.jit(device=True, **INLINE)(_finish_runs)
finish_counters = cuda.jit(device=True, **INLINE)(_finish_counters)


def index_bits(Nm: int, Nr: int) -> tuple[int, int]:
    """(main bits, residual bits) for supported codebook sizes."""
    if Nm not in SUPPORTED_MAIN:
        raise ValueError(f"main codebook size Nm must be one of {SUPPORTED_MAIN}, got {Nm}")
    if Nr not in SUPPORTED_RES:
        raise ValueError(f"residual codebook size Nr must be one of {SUPPORTED_RES}, got {Nr}")
    return int(math.log2(Nm)), int(math.log2(Nr))


def index_bits_per_weight(Nm: int, Nr: int) -> float:
    """Index bits a weight: a vector's main and residual index bits over its VECTOR_LEN weights."""
    return sum(index_bits(Nm, Nr)) / VECTOR_LEN


def check_in_features(in_features: int) -> None:
    if in_features <= 0 or in_features % CHUNK:
        raise ValueError(
            f"in_features={in_features} is not divisible by {CHUNK}: vectors of {VECTOR_LEN} weights are packed "
            f"{VECS_PER_CHUNK} to a chunk of whole 32-bit words, and the kernel streams whole chunks")


# -- packing ---------------------------------------------------------------------------------
def _field_positions(b: int):
    """(vector i, word, shift, straddles) of each of a chunk's 32 fields."""
    out = []
    for i in range(VECS_PER_CHUNK):
        bit = i * b
        out.append((i, bit >> 5, bit & 31, (bit & 31) + b > 32))
    return out


def pack_indices(im: torch.Tensor, ir: torch.Tensor, Nm: int, Nr: int) -> torch.Tensor:
    """(out, in/8) main and residual indices -> (out, in*b/256) int32 words, LSB-first fields."""
    bm, br = index_bits(Nm, Nr)
    b = bm + br
    if im.shape != ir.shape or im.dim() != 2:
        raise ValueError(f"main and residual indices must be 2-D of one shape, got {tuple(im.shape)} and {tuple(ir.shape)}")
    for name, t, n in (("main", im, Nm), ("residual", ir, Nr)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise TypeError(f"{name} indices must be integers, got {t.dtype}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
            raise ValueError(f"{name} indices out of range: found [{int(t.min())}, {int(t.max())}], allowed [0, {n - 1}]")
    n_out, G = im.shape
    check_in_features(G * VECTOR_LEN)
    nch = G // VECS_PER_CHUNK
    f = (im.long() | (ir.long() << bm)).reshape(n_out, nch, VECS_PER_CHUNK)
    words = torch.zeros(n_out, nch, b, dtype=torch.int64, device=im.device)
    for i, w, s, straddle in _field_positions(b):
        words[:, :, w] |= (f[:, :, i] << s) & 0xFFFFFFFF
        if straddle:
            words[:, :, w + 1] |= f[:, :, i] >> (32 - s)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).reshape(n_out, nch * b).contiguous()


def unpack_indices(words: torch.Tensor, Nm: int, Nr: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_indices`: (main, residual) int64 indices (out, in/8)."""
    bm, br = index_bits(Nm, Nr)
    b = bm + br
    n_out = words.shape[0]
    w = (words.long() & 0xFFFFFFFF).reshape(n_out, -1, b)
    f = torch.empty(n_out, w.shape[1], VECS_PER_CHUNK, dtype=torch.int64, device=words.device)
    for i, j, s, straddle in _field_positions(b):
        v = w[:, :, j] >> s
        if straddle:
            v = v | (w[:, :, j + 1] << (32 - s))
        f[:, :, i] = v & ((1 << b) - 1)
    f = f.reshape(n_out, -1)
    return f & (Nm - 1), f >> bm


# -- the format ------------------------------------------------------------------------------
@dataclass
class ResidualTensor:
    """A residual-VQ weight: packed index words, main and residual fp16 codebooks, optional norm."""

    indices: torch.Tensor  # int32 (out, in * b / 256), natural layout
    main: torch.Tensor  # float16 (Nm, 8)
    res: torch.Tensor  # float16 (Nr, 8)
    in_features: int
    out_features: int
    scale: torch.Tensor | None = None  # float16 (in,)
    bias: torch.Tensor | None = None  # float16 (in,)

    def __post_init__(self):
        self.validate()

    @property
    def Nm(self) -> int:
        return int(self.main.shape[0])

    @property
    def Nr(self) -> int:
        return int(self.res.shape[0])

    @property
    def bits(self) -> tuple[int, int]:
        return index_bits(self.Nm, self.Nr)

    @property
    def has_norm(self) -> bool:
        return self.scale is not None

    @property
    def nbytes(self) -> int:
        n = self.indices.numel() * 4 + (self.main.numel() + self.res.numel()) * 2
        return n + (2 * self.in_features * 2 if self.has_norm else 0)

    @property
    def bits_per_weight(self) -> float:
        """Index bits (b / 8) plus the codebooks' and norm's share over the whole layer."""
        return self.nbytes * 8 / (self.in_features * self.out_features)

    def validate(self) -> None:
        n_in, n_out = self.in_features, self.out_features
        if self.main.dim() != 2 or self.main.shape[1] != VECTOR_LEN:
            raise CodebookFormatError(f"main codebook must be (Nm, {VECTOR_LEN}), got {tuple(self.main.shape)} "
                                      f"(only vector length {VECTOR_LEN} is supported)")
        if self.res.dim() != 2 or self.res.shape[1] != VECTOR_LEN:
            raise CodebookFormatError(f"residual codebook must be (Nr, {VECTOR_LEN}), got {tuple(self.res.shape)}")
        try:
            bm, br = self.bits
            check_in_features(n_in)
        except ValueError as e:
            raise CodebookFormatError(str(e)) from e
        if n_out <= 0:
            raise CodebookFormatError(f"out_features must be positive, got {n_out}")
        for name, t in (("main", self.main), ("res", self.res)):
            if t.dtype != torch.float16:
                raise CodebookFormatError(f"{name} codebook must be float16, got {t.dtype}")
            if not torch.isfinite(t).all():
                raise CodebookFormatError(f"{name} codebook has NaN/Inf entries")
        if self.indices.dtype != torch.int32:
            raise CodebookFormatError(f"indices must be int32 words, got {self.indices.dtype}")
        want = (n_out, n_in * (bm + br) // CHUNK)
        if tuple(self.indices.shape) != want:
            raise CodebookFormatError(f"indices shape {tuple(self.indices.shape)} != {want} for out={n_out}, in={n_in}, "
                                      f"{bm}+{br} bits a vector")
        if (self.scale is None) != (self.bias is None):
            raise CodebookFormatError("scale and bias come together (VPTQ's enable_norm) or not at all")
        for name, t in (("scale", self.scale), ("bias", self.bias)):
            if t is None:
                continue
            if t.dtype != torch.float16 or tuple(t.shape) != (n_in,):
                raise CodebookFormatError(f"{name} must be float16 of shape ({n_in},), got {t.dtype} {tuple(t.shape)}")
            if not torch.isfinite(t).all():
                raise CodebookFormatError(f"{name} has NaN/Inf entries")
        devs = {t.device for t in (self.indices, self.main, self.res, self.scale, self.bias) if t is not None}
        if len(devs) > 1:
            raise CodebookFormatError(f"tensors on several devices: {sorted(map(str, devs))}")
        # Every b-bit field is a valid (main, residual) pair: the sizes are powers of two.

    def to(self, device) -> "ResidualTensor":
        mv = (lambda t: None if t is None else t.to(device))
        return ResidualTensor(self.indices.to(device), self.main.to(device), self.res.to(device), self.in_features,
                              self.out_features, mv(self.scale), mv(self.bias))

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(main, residual) indices, int64 (out, in/8)."""
        return unpack_indices(self.indices, self.Nm, self.Nr)

    def dequantize(self, dtype=torch.float16, rows: int = 4096) -> torch.Tensor:
        """The (out, in) weight: main + residual (summed in fp32, or in dtype if wider), then norm."""
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        W = torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.indices.device)
        main, res = self.main.to(acc), self.res.to(acc)
        for r0 in range(0, self.out_features, rows):
            im, ir = unpack_indices(self.indices[r0:r0 + rows], self.Nm, self.Nr)
            w = (main[im] + res[ir]).reshape(im.shape[0], self.in_features)
            if self.has_norm:
                w = w * self.scale.to(acc) + self.bias.to(acc)
            W[r0:r0 + rows] = w.to(dtype)
        return W

    # -- serialization -------------------------------------------------------------------
    def _tensors(self) -> dict:
        t = {"indices": self.indices, "main": self.main, "res": self.res}
        if self.has_norm:
            t.update(scale=self.scale, bias=self.bias)
        return t

    def header(self) -> dict:
        bm, br = self.bits
        return {
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            "vector_len": VECTOR_LEN,
            "main_centroids": self.Nm,
            "residual_centroids": self.Nr,
            "index_bits": [bm, br],
            "packing": "lsb-first fields main|res<<main_bits, int32 words",
            "in_features": self.in_features,
            "out_features": self.out_features,
            "norm": self.has_norm,
            "shapes": {k: list(v.shape) for k, v in self._tensors().items()},
            "sha256": {k: _sha(v) for k, v in self._tensors().items()},
        }

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self._tensors().items()}
        save_file(tensors, str(path), metadata={"trapetum": json.dumps(self.header())})
        return path

    @classmethod
    def load(cls, path: str | Path, device="cpu") -> "ResidualTensor":
        h, tensors = read_layer_file(path, KIND, FORMAT_VERSION, "residual codebook")
        path = Path(path)
        if h.get("vector_len") != VECTOR_LEN:
            raise CodebookFormatError(f"{path}: vector_len {h.get('vector_len')!r}, only {VECTOR_LEN} is supported")
        want = {"indices", "main", "res"} | ({"scale", "bias"} if h.get("norm") else set())
        if set(tensors) != want:
            raise CodebookFormatError(f"{path}: expected tensors {sorted(want)}, found {sorted(tensors)}")
        try:
            Nm, Nr = int(h["main_centroids"]), int(h["residual_centroids"])
            n_in, n_out = int(h["in_features"]), int(h["out_features"])
            bits = list(index_bits(Nm, Nr))
        except (KeyError, TypeError, ValueError) as e:
            raise CodebookFormatError(f"{path}: bad header (sizes): {e}") from e
        if h.get("index_bits") != bits:
            raise CodebookFormatError(f"{path}: index_bits {h.get('index_bits')} do not fit Nm={Nm}, Nr={Nr}")
        for name, t in tensors.items():
            if list(t.shape) != h.get("shapes", {}).get(name):
                raise CodebookFormatError(f"{path}: {name} shape {list(t.shape)} != header {h.get('shapes', {}).get(name)}")
            if _sha(t) != h.get("sha256", {}).get(name):
                raise CodebookFormatError(f"{path}: {name} bytes do not match the header's SHA-256 (file tampered or corrupt)")
        if tensors["main"].shape[0] != Nm or tensors["res"].shape[0] != Nr:
            raise CodebookFormatError(f"{path}: codebook sizes {tensors['main'].shape[0]}/{tensors['res'].shape[0]} != header {Nm}/{Nr}")
        try:
            t = cls(tensors["indices"], tensors["main"], tensors["res"], n_in, n_out, tensors.get("scale"), tensors.get("bias"))
        except (ValueError, TypeError) as e:
            raise CodebookFormatError(f"{path}: {e}") from e
        return t.to(device)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def random_residual_tensor(out_features: int, in_features: int, Nm: int = 4096, Nr: int = 256, seed: int = 0, device="cpu",
                           with_norm: bool = False, generator: torch.Generator | None = None) -> ResidualTensor:
    """Random words (every b-bit field is a valid index pair) and normal codebooks, made on ``device``
    (from ``generator`` where given, else one seeded with ``seed``).

    The residual codebook is ~4x smaller than the main one, as k-means of residuals gives.
    """
    bm, br = index_bits(Nm, Nr)
    check_in_features(in_features)
    g = generator if generator is not None else torch.Generator(device=device).manual_seed(seed)
    words = torch.randint(-(2**31), 2**31, (out_features, in_features * (bm + br) // CHUNK), dtype=torch.int64,
                          device=device, generator=g).to(torch.int32)
    main = (torch.randn(Nm, VECTOR_LEN, device=device, generator=g) * 0.02).half()
    res = (torch.randn(Nr, VECTOR_LEN, device=device, generator=g) * 0.005).half()
    scale = bias = None
    if with_norm:
        scale = (1 + 0.25 * torch.rand(in_features, device=device, generator=g)).half()
        bias = (0.01 * torch.randn(in_features, device=device, generator=g)).half()
    return ResidualTensor(words, main, res, in_features, out_features, scale, bias)


# -- quantizer -------------------------------------------------------------------------------
@dataclass
class ResidualReport:
    Nm: int
    Nr: int
    iters: int
    rel_mse_main: float  # after the main codebook alone (Hessian-diagonal weighted when calibrated)
    rel_mse: float  # after main + residual
    max_abs_err: float
    weighted: bool
    errors: dict = field(default_factory=dict)  # per-stage error history


def _nearest(V: torch.Tensor, h: torch.Tensor | None, C: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """Index of the (column-weighted) nearest centroid of every vector: argmin sum_k h_k (v_k - c_k)^2.

    Rows in blocks of ``rows`` keep the (rows, K) distance block in cache (memory, not FLOPs, is the cost at 8 dims).
    """
    out = torch.empty(V.shape[0], dtype=torch.int64, device=V.device)
    C2 = (C * C).T.contiguous()  # (8, K)
    CT = C.T.contiguous()
    c2 = C2.sum(0)
    for r0 in range(0, V.shape[0], rows):
        v = V[r0:r0 + rows]
        if h is None:
            d = torch.addmm(c2, v, CT, alpha=-2)
        else:
            hv = h[r0:r0 + rows]
            d = torch.addmm(hv @ C2, hv * v, CT, alpha=-2)
        out[r0:r0 + rows] = d.argmin(1)
    return out


def _kmeans(V: torch.Tensor, h: torch.Tensor | None, K: int, iters: int, gen: torch.Generator, desc: str, progress: bool,
            history: list, sample: int) -> torch.Tensor:
    """Weighted Lloyd k-means of (N, 8) vectors, trained on at most ``sample`` of them (seeded);
    returns the centroids (K, 8), fp32. The caller assigns every vector at the end."""
    from tqdm.auto import tqdm

    perm = torch.randperm(V.shape[0], generator=gen).to(V.device)
    if V.shape[0] > sample:
        V = V[perm[:sample]]
        h = None if h is None else h[perm[:sample]]
        perm = torch.arange(sample, device=V.device)
    N = V.shape[0]
    if N >= K:
        C = V[perm[:K]].clone()
    else:
        # Fewer vectors than centroids: every vector gets its own centroid (an exact fit); the
        # rest start as perturbed copies, so the codebook has no duplicates and nothing breaks.
        extra = torch.randint(0, N, (K - N,), generator=gen).to(V.device)
        noise = torch.randn(K - N, V.shape[1], generator=gen).to(V.device) * (V.std() * 1e-2 + 1e-6)
        C = torch.cat([V[perm], V[extra] + noise])
    hw = torch.ones_like(V) if h is None else h
    assign = _nearest(V, h, C)
    for _ in tqdm(range(iters), desc=desc, disable=not progress, leave=False):
        sums = torch.zeros_like(C).index_add_(0, assign, V * hw)
        cnt = torch.zeros_like(C).index_add_(0, assign, hw)
        C = torch.where(cnt > 0, sums / cnt.clamp_min(1e-30), C)  # an empty cluster keeps its centroid
        new = _nearest(V, h, C)
        history.append(float(((V - C[new]) ** 2 * hw).sum()))
        if torch.equal(new, assign):
            assign = new
            break
        assign = new
    return C


def quantize_residual(W: torch.Tensor, Nm: int = 4096, Nr: int = 256, X: torch.Tensor | None = None,
                      H: torch.Tensor | None = None, iters: int = 8, seed: int = 0, norm: bool = False,
                      sample: int = 2**16, progress: bool = True) -> tuple[ResidualTensor, ResidualReport]:
    """k-means of W's 8-weight vectors into Nm main centroids, then of the residuals into Nr.

    With calibration data (X (n, in) activations, or H = X^T X (in, in)) each column's error is
    weighted by diag(H), as VPTQ's Hessian-weighted k-means does. ``norm``: normalize each input
    column first (scale = std, bias = mean; VPTQ's enable_norm). Runs on W's device, deterministic
    for a seed. Each k-means trains on at most ``sample`` vectors (a seeded subset), then assigns all.
    """
    index_bits(Nm, Nr)
    if W.dim() != 2:
        raise ValueError(f"W must be 2-D (out_features, in_features), got shape {tuple(W.shape)}")
    n_out, n_in = W.shape
    check_in_features(n_in)
    check_finite(W)
    if X is not None and H is not None:
        raise ValueError("give calibration activations X or their Hessian H, not both")
    dev = W.device
    Wf = W.detach().float()
    hdiag = None
    if X is not None:
        check_finite(X, "X")
        if X.shape[-1] != n_in:
            raise ValueError(f"X has {X.shape[-1]} features, W has {n_in} input columns")
        Xf = X.detach().to(dev, torch.float32).reshape(-1, n_in)
        hdiag = (Xf * Xf).sum(0)
    elif H is not None:
        check_finite(H, "H")
        if tuple(H.shape) != (n_in, n_in):
            raise ValueError(f"H must be ({n_in}, {n_in}), got {tuple(H.shape)}")
        hdiag = H.detach().to(dev, torch.float32).diagonal().clone()
    if hdiag is not None:
        if (hdiag < 0).any():
            raise ValueError("the Hessian's diagonal must be non-negative")
        hdiag = hdiag / hdiag.mean().clamp_min(1e-30) + 1e-6  # scale-free; an all-zero column still counts a little
    scale = bias = None
    if norm:
        bias = Wf.mean(0)
        scale = Wf.std(0).clamp_min(1e-8)
        scale, bias = scale.half(), bias.half()
        Wn = (Wf - bias.float()) / scale.float()
    else:
        Wn = Wf
    G = n_in // VECTOR_LEN
    V = Wn.reshape(n_out * G, VECTOR_LEN)
    h = None
    if hdiag is not None:
        hcol = hdiag if scale is None else hdiag * scale.float() ** 2  # error in W, not in normalized W
        h = hcol.reshape(1, G, VECTOR_LEN).expand(n_out, G, VECTOR_LEN).reshape(-1, VECTOR_LEN).contiguous()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hist_m, hist_r = [], []
    Cm = _kmeans(V, h, Nm, iters, gen, f"main k-means ({Nm})", progress, hist_m, sample)
    main = Cm.half()
    im = _nearest(V, h, main.float())
    R = V - main.float()[im]
    Cr = _kmeans(R, h, Nr, iters, gen, f"residual k-means ({Nr})", progress, hist_r, sample)
    res = Cr.half()
    ir = _nearest(R, h, res.float())
    words = pack_indices(im.reshape(n_out, G), ir.reshape(n_out, G), Nm, Nr)
    t = ResidualTensor(words, main, res, n_in, n_out, scale, bias)

    w = torch.ones(n_in, device=dev) if hdiag is None else hdiag
    denom = (Wf * Wf * w).sum().clamp_min(1e-30)
    main_only = (main.float()[im].reshape(n_out, n_in))
    if norm:
        main_only = main_only * scale.float() + bias.float()
    W_hat = t.dequantize(torch.float32)
    rep = ResidualReport(
        Nm=Nm, Nr=Nr, iters=iters,
        rel_mse_main=float(((Wf - main_only) ** 2 * w).sum() / denom),
        rel_mse=float(((Wf - W_hat) ** 2 * w).sum() / denom),
        max_abs_err=float((Wf - W_hat).abs().max()),
        weighted=hdiag is not None,
        errors={"main_kmeans": hist_m, "residual_kmeans": hist_r},
    )
    return t, rep


# -- the fused GEMV --------------------------------------------------------------------------
def scheme_name(Nm: int, Nr: int) -> str:
    """How records and tables name a residual configuration."""
    return f"residual VQ {Nm}+{Nr} (v={VECTOR_LEN})"


def index_bytes(n_in: int, n_out: int, Nm: int, Nr: int) -> int:
    """Bytes of an out x in layer's packed index words (bm + br bits a vector of 8 weights)."""
    bm, br = index_bits(Nm, Nr)
    return n_out * n_in * (bm + br) // 64


def tile_indices(words: torch.Tensor, out_features: int, b: int) -> torch.Tensor:
    """The kernel's layout: rows padded to 32, then [row-block][chunk][word][lane], flat int32.

    A warp reading word w of chunk j of its row-block reads 128 contiguous bytes.
    """
    rbs = -(-out_features // ROW_BLOCK)
    pad = rbs * ROW_BLOCK - out_features
    if pad:
        words = torch.cat([words, words.new_zeros(pad, words.shape[1])])
    nchunks = words.shape[1] // b
    return words.reshape(rbs, ROW_BLOCK, nchunks, b).permute(0, 2, 3, 1).contiguous().reshape(-1)


def skew_indices(words: torch.Tensor, Nm: int, Nr: int, G: int = 16, inverse: bool = False, rows: int = 4096) -> torch.Tensor:
    """The banked table kernel's order of a row's fields (natural (out, n_words) words in and out): in
    each run of G vectors of row r, position i holds vector (i + k) % G, k = (r % 32) // (32 // G), the
    group offset of the lane that owns the row (see ``banked`` in :func:`residual_table_kernel`);
    ``inverse`` undoes it. Works through ``rows`` rows at a time."""
    if G < 1 or 32 % G or VECS_PER_CHUNK % G:
        raise ValueError(f"G must divide 32, got {G}")
    out = torch.empty_like(words)
    for r0 in range(0, words.shape[0], rows):
        w = words[r0:r0 + rows]
        im, ir = unpack_indices(w, Nm, Nr)
        k = (torch.arange(r0, r0 + w.shape[0], device=w.device) % 32) // (32 // G)
        i = torch.arange(im.shape[1], device=w.device)
        src = (i - i % G)[None, :] + (i % G + (-k if inverse else k)[:, None]) % G
        out[r0:r0 + rows] = pack_indices(im.gather(1, src), ir.gather(1, src), Nm, Nr)
    return out


def untile_indices(tiled: torch.Tensor, out_features: int, n_words: int, b: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The natural (out, n_words) int32 words back from :func:`tile_indices` (a copy); ``rows=(r0, r1)``
    (r0 a multiple of 32): only those rows, untiling only their row-blocks."""
    rbs = -(-out_features // ROW_BLOCK)
    r0, r1 = check_rows(rows, out_features)
    b0, b1 = r0 // ROW_BLOCK, -(-r1 // ROW_BLOCK)
    t = tiled.reshape(rbs, n_words // b, b, ROW_BLOCK)[b0:b1].permute(0, 3, 1, 2)
    return t.reshape((b1 - b0) * ROW_BLOCK, n_words)[:r1 - r0].contiguous()


_kernel_cache: dict = {}


def _step_layout(b: int, G: int) -> list[tuple[int, int, list]]:
    """For each table step s of a chunk (vectors s*G .. s*G+G-1): (first word, words spanned,
    [(word relative to the first, shift, straddles)] of its G fields)."""
    pos = _field_positions(b)
    out = []
    for s in range(VECS_PER_CHUNK // G):
        fields = pos[s * G:(s + 1) * G]
        w_lo = fields[0][1]
        w_hi = max(w + st for _, w, _, st in fields)
        out.append((w_lo, w_hi - w_lo + 1, [(w - w_lo, sh, st) for _, w, sh, st in fields]))
    return out


def _row_loader(WPC: int):
    """``load_row(dst, off, tiled, rb, lane, ok, nchunks, j, w_lo, nw)``: words w_lo .. w_lo + nw - 1 of
    chunk j of row ``lane`` of row-block rb into dst[off ...] (zeros where ``ok`` is false)."""
    zero = int32(0)

    @cuda.jit(device=True, **INLINE)
    def load_row(dst, off, tiled, rb, lane, ok, nchunks, j, w_lo, nw):
        base = uint32((rb * nchunks + j) * (WPC * 32) + w_lo * 32) + lane
        for q in range(nw):
            dst[off + q] = tiled[base + uint32(q * 32)] if ok else zero

    return load_row


def _word_loader(RB: int, WPC: int, lanes: int = 1):
    """Both residual kernels' index-word load: ``load_words(dst, off, stride, tiled, rb0, rbs,
    nchunks, j, w_lo, nw, valid)`` puts words w_lo .. w_lo + nw - 1 of chunk j of this lane's row in
    each of the warp's RB row-blocks at dst[off + r * stride + ...] (zeros past the last row-block
    or where ``valid`` is false). The offsets are 32-bit unsigned: a signed index costs a
    negative-index check and the array's shape from parameter space on every load (measured in
    the SASS: ~17 instructions a word); ResidualGemv refuses layers of 2**32 words or more.

    ``lanes`` S > 1 (the split kernel's lane split, RB = 1): rb0 names a group of 32 / S rows, the
    (rb0 % S)-th of row-block rb0 // S, and lane l reads row l % (32 / S) of it (its caller passes
    each lane its own chunk j)."""
    S, R = uint32(lanes), uint32(32 // lanes)
    load_row = _row_loader(WPC)

    @cuda.jit(device=True, **INLINE)
    def load_words(dst, off, stride, tiled, rb0, rbs, nchunks, j, w_lo, nw, valid):
        lane = uint32(cuda.laneid)
        if lanes > 1:
            g = uint32(rb0)
            rb0 = g // S
            lane = (g - rb0 * S) * R + (lane & (R - uint32(1)))
        for r in range(RB):
            load_row(dst, off + r * stride, tiled, rb0 + r, lane, valid and rb0 + r < rbs, nchunks, j, w_lo, nw)

    return load_words


def _common_device_functions(B: int, nt: int, RB: int, norm: bool, pad: int = 0, wide: bool = False,
                             fanin: int = 0, spread: bool = False):
    """What both residual kernels share: staging a K-slice of x, and writing the rows out.

    ``stage_x`` puts x[:, col0:col0+ncols] in shared memory as fp32 (times scale under a norm), ``pad``
    floats after each chunk of CHUNK columns (a batch row's stride is then ncols + ncols / CHUNK x pad), and
    keeps each thread's part of dot(bias, x) in ``pb``; ``finish`` adds the block's dot(bias, x),
    then writes y (one K-slice) or the slice's partial, and the last block of a row-group to finish
    sums the partials (an atomic counter it resets, so the launch replays in a CUDA graph).

    ``wide`` (the table kernel, whose blocks own whole row-groups of nt x RB rows): the partials are
    summed in 16-byte loads, 4 consecutive rows a thread, SR K-slices a round (up to
    :data:`FINISH_LOADS` 16-byte loads in flight a thread), and, with ``fanin`` > 0, in two levels
    where there are more than ``fanin`` K-slices: the last block of each run of ``fanin`` slices sums them
    into a slot of ws after the K-slices' (``ws`` then has nsplit + ceil(nsplit / fanin) slices;
    counters a row-group's run after the row-groups' counters; see :func:`finish_sizes`), and the
    last of those sums the slots into y: the level-one sums run while other blocks still work, and
    the last block reads fanin + nsplit / fanin slices instead of nsplit, for one more counter
    handshake (on the H200 it won at 32 K-slices and lost at 16 or fewer, so the tuner times both;
    NOTES.md, session 65). Every sum runs in slice order: deterministic. ``finish`` returns 2 for the block that wrote y from the partials, 1 for a
    level-one summer, 0 otherwise (the timeline's ``sums``).

    With ``spread`` (wide only) ``finish`` only writes the partial, and ``spread_finish`` (the caller's, after
    it) sums the K-split over all the row-group's blocks instead of its last one: the one summing block read
    nsplit x nt x RB x 4 bytes (229 KiB at 4096 x 28672, RB 7, K-split 16, ~3 us at the ~72 GB/s an SM
    draws from the L2) while the other SMs idled. Each block counts in, waits for the row-group's
    K-slices (:func:`trapetum.gemv.arrive_and_wait`: only where every block runs at once), and sums
    1 / nsplit of the rows. :func:`finish_sizes`: a second counter a row-group (:func:`trapetum.gemv.depart`).
    """
    from .gemv import arrive_and_wait, depart, last_to_finish, load_cg, load_cg4

    def slice_summer(NV, SR):
        """add_slices(ws, lo, hi, row0, lim, tot): tot += ws[lo:hi] (slice order) at a thread's NV row quads,
        rows row0 + 4 nt v (clamped below lim: the rows past it are summed, never written), SR K-slices a round."""
        TOT = NV * B * 4  # (local array sizes must be literals)
        BUF = SR * TOT

        @cuda.jit(device=True, **INLINE)
        def add_slices(ws, lo, hi, row0, lim, tot):
            buf = cuda.local.array(BUF, float32)
            sp0 = lo
            while sp0 < hi:
                # A round's loads first, unconditional (indices clamped into ws), then its adds: issue is
                # in order, so a load behind an add waits for the add's operand. (With each load and its
                # adds under their own branch, the loads went out one after another: ~0.1 us each.)
                for k in range(SR):
                    sp = min(sp0 + k, hi - 1)
                    for v in range(NV):
                        row = min(row0 + 4 * nt * v, lim - 4)
                        for bb in range(B):
                            o = ((k * NV + v) * B + bb) * 4
                            buf[o], buf[o + 1], buf[o + 2], buf[o + 3] = load_cg4(ws, sp, bb, row)
                for k in range(SR):
                    if sp0 + k < hi:  # the same for the whole block
                        for i in range(TOT):
                            tot[i] += buf[k * TOT + i]
                sp0 += SR

        return add_slices

    NV = -(-RB // 4)  # 16-byte row quads a thread
    TOT = NV * B * 4
    add_slices = slice_summer(NV, max(1, FINISH_LOADS // (NV * B)))
    SSR = max(1, FINISH_LOADS // B)  # spread: K-slices a round of a thread's one quad
    add_quad_slices = slice_summer(1, SSR)
    QB = 4 * B
    GROUP_QUADS = nt * RB // 4  # a row-group's 16-byte row quads

    @cuda.jit(device=True, **INLINE)
    def sum_slices(ws, lo, hi, dst, y, grp, rbs, n_out, tid):
        # ws[lo:hi] (this block's partial too) in slice order, into ws[dst] or, with dst < 0, into y.
        r0 = grp * (nt * RB)
        lim = min(r0 + nt * RB, rbs * 32)  # ws rows (a multiple of 4, past r0)
        tot = cuda.local.array(TOT, float32)
        for i in range(TOT):
            tot[i] = 0.0
        add_slices(ws, lo, hi, r0 + 4 * tid, lim, tot)
        for v in range(NV):
            row = r0 + 4 * (tid + v * nt)
            if row < lim:
                for bb in range(B):
                    o = (v * B + bb) * 4
                    if dst >= 0:
                        ws[dst, bb, row], ws[dst, bb, row + 1] = tot[o], tot[o + 1]
                        ws[dst, bb, row + 2], ws[dst, bb, row + 3] = tot[o + 2], tot[o + 3]
                    else:
                        for i in range(4):
                            if row + i < n_out:
                                y[bb, row + i] = tot[o + i]

    @cuda.jit(device=True, **INLINE)
    def spread_finish(ws, y, counters, scratch, grp, rbs, n_out, tid):
        # Every block of the row-group: wait for all its K-slices' partials, sum a 1 / nsplit share of the
        # rows into y, P threads a quad (each over a run of the slices, in one round where P allows), their
        # sums added in shared memory (``scratch``: the table's, free after the walk) in slice order.
        # Every thread calls it (barriers). Returns 3 (the timeline's ``sums``).
        split = cuda.blockIdx.y
        nsplit = cuda.gridDim.y
        arrive_and_wait(counters, grp, nsplit, tid)
        r0 = grp * (nt * RB)
        lim = min(r0 + nt * RB, rbs * 32)
        share = (GROUP_QUADS + nsplit - 1) // nsplit  # quads a block: at most nt (RB <= 8 <= 4 x K-split)
        q0 = split * share
        nq = min(share, (lim - r0) // 4 - q0)  # this block's quads (none past the rows)
        P = max(1, min(nt // share, (nsplit + SSR - 1) // SSR))  # threads a quad
        per = (nsplit + P - 1) // P  # K-slices a thread
        lq = tid // P
        part = tid - lq * P
        active = lq < nq
        row = r0 + 4 * (q0 + lq)
        tot = cuda.local.array(QB, float32)
        for i in range(QB):
            tot[i] = 0.0
        if active:
            add_quad_slices(ws, part * per, min(part * per + per, nsplit), row, lim, tot)
        if P > 1:  # (the same for the whole block)
            if active:
                for i in range(QB):
                    scratch[tid * QB + i] = tot[i]
            cuda.syncthreads()
            if active and part == 0:
                for pp in range(1, P):
                    for i in range(QB):
                        tot[i] += scratch[(tid + pp) * QB + i]
        if active and part == 0:
            for bb in range(B):
                for i in range(4):
                    if row + i < n_out:
                        y[bb, row + i] = tot[bb * 4 + i]
        depart(counters, grp, cuda.gridDim.x + grp, nsplit, tid)
        return 3

    @cuda.jit(device=True, **INLINE)
    def stage_x(x32, sc32, bi32, xs, xoff, col0, ncols, pb, tid):
        xq = ncols // 8
        xbase = col0 // 2
        for bb in range(B):
            pb[bb] = 0.0
        for t in range(tid, B * xq, nt):
            bb = t // xq
            q = t - bb * xq
            w0, w1, w2, w3 = load16(x32[bb], xbase + q * 4)
            o = xoff + bb * (ncols + (ncols // CHUNK) * pad) + q * 8 + (q // VECS_PER_CHUNK) * pad
            v0, v1 = half2_to_float2(w0)
            v2, v3 = half2_to_float2(w1)
            v4, v5 = half2_to_float2(w2)
            v6, v7 = half2_to_float2(w3)
            if norm:
                s0, s1, s2, s3 = load16(sc32, xbase + q * 4)
                e0, e1, e2, e3 = load16(bi32, xbase + q * 4)
                g0, g1 = half2_to_float2(e0)
                g2, g3 = half2_to_float2(e1)
                g4, g5 = half2_to_float2(e2)
                g6, g7 = half2_to_float2(e3)
                pb[bb] += g0 * v0 + g1 * v1 + g2 * v2 + g3 * v3 + g4 * v4 + g5 * v5 + g6 * v6 + g7 * v7
                h0, h1 = half2_to_float2(s0)
                h2, h3 = half2_to_float2(s1)
                h4, h5 = half2_to_float2(s2)
                h6, h7 = half2_to_float2(s3)
                v0, v1, v2, v3, v4, v5, v6, v7 = v0 * h0, v1 * h1, v2 * h2, v3 * h3, v4 * h4, v5 * h5, v6 * h6, v7 * h7
            xs[o], xs[o + 1], xs[o + 2], xs[o + 3] = v0, v1, v2, v3
            xs[o + 4], xs[o + 5], xs[o + 6], xs[o + 7] = v4, v5, v6, v7

    @cuda.jit(device=True, **INLINE)
    def add_bias_dot(acc, pb, bpart, bred, tid):
        # Under a norm: dot(bias, x) over this K-slice, the same for every row, added to acc (every thread
        # calls it: it holds barriers). Warp 0 folds the nt threads' partials to 32.
        lane = cuda.laneid
        for bb in range(B):
            bpart[bb * nt + tid] = pb[bb]
        cuda.syncthreads()
        if tid < 32:
            for bb in range(B):
                s = float32(0.0)
                for t in range(lane, nt, 32):
                    s += bpart[bb * nt + t]
                bred[bb * 32 + lane] = s
        cuda.syncthreads()
        for bb in range(B):
            s = float32(0.0)
            for t in range(32):
                s += bred[bb * 32 + t]
            for r in range(RB):
                acc[r * B + bb] += s

    @cuda.jit(device=True, **INLINE)
    def finish(acc, pb, bpart, bred, last, y, ws, counters, grp, own, rb0, rbs, n_out, tid):
        # grp: the row-group's counter; own: whether this thread's acc is the block's sum for its rows
        # (every thread of the block calls finish: the norm's sums and the counter hold barriers).
        lane = cuda.laneid
        split = cuda.blockIdx.y
        nsplit = cuda.gridDim.y
        if norm:
            add_bias_dot(acc, pb, bpart, bred, tid)
        for r in range(RB):  # a literal bound: acc stays in registers
            rb = rb0 + r
            row = rb * 32 + lane
            for bb in range(B):
                if own and nsplit == 1:
                    if row < n_out:
                        y[bb, row] = acc[r * B + bb]
                elif own and rb < rbs:
                    ws[split, bb, row] = acc[r * B + bb]
        level = 0
        if wide and nsplit > 1 and spread:
            pass  # the caller's spread_finish, after this (it needs the table's shared memory)
        elif wide and nsplit > 1:
            nsub = finish_runs(nsplit, fanin)
            if nsub == 0:
                if last_to_finish(counters, grp, nsplit, last, tid):
                    sum_slices(ws, 0, nsplit, -1, y, grp, rbs, n_out, tid)
                    level = 2
            else:
                sub = split // fanin
                lo = sub * fanin
                hi = min(lo + fanin, nsplit)
                if last_to_finish(counters, cuda.gridDim.x + grp * nsub + sub, hi - lo, last, tid):
                    sum_slices(ws, lo, hi, nsplit + sub, y, grp, rbs, n_out, tid)
                    level = 1
                    if last_to_finish(counters, grp, nsub, last, tid):
                        sum_slices(ws, nsplit, nsplit + nsub, -1, y, grp, rbs, n_out, tid)
                        level = 2
        elif nsplit > 1 and last_to_finish(counters, grp, nsplit, last, tid) and own:
            # K-slices outer, rows inner: the RB x B loads of a slice are independent, so they are in
            # flight together. (Rows outer made a chain of nsplit dependent L2 round trips a row, RB
            # rows one after another: ~16 x 8 round trips at RB = 8, nsplit = 16, while the other SMs
            # idle.) This block's own partial is still in acc.
            for sp in range(nsplit):
                if sp != split:
                    for r in range(RB):
                        if rb0 + r < rbs:
                            for bb in range(B):
                                acc[r * B + bb] += load_cg(ws, sp, bb, (rb0 + r) * 32 + lane)
            for r in range(RB):
                row = (rb0 + r) * 32 + lane
                if row < n_out:
                    for bb in range(B):
                        y[bb, row] = acc[r * B + bb]
        return level

    return stage_x, finish, add_bias_dot, spread_finish


def _chunk_source(b: int) -> str:
    """chunk_dot: one vec() call for each of a chunk's 32 vectors, every bit offset a constant.

    The constants go in as int32(...), not as bare literals: numba types a literal argument as its own
    type and compiled vec once per call site (64 front-end compiles: ~80 % of a 33 s compile on the CPU).
    vec and chunk_dot are force-inlined, so LLVM still sees every offset as a constant after inlining."""
    lines = ["def chunk_dot(ring, s, mainq, dyn_i, xs, xo, ncols, acc, wv):"]
    for i, w, sh, straddle in _field_positions(b):
        lines.append(f"    vec(ring, s, int32({w}), int32({sh}), int32({int(straddle)}), int32({i}), mainq, dyn_i, xs, xo, ncols, acc, wv)")
    return "\n".join(lines) + "\n"


def residual_kernel(Nm: int, Nr: int, B: int, warps: int, RB: int, main_shared: bool, norm: bool, split: bool = False,
                    rc: int = 1, lanes: int = 1):
    """The "gather" residual-VQ GEMV (v1): every vector's weights rebuilt from two 16-byte codebook reads.

    Grid (row-groups, K-slices); a block has ``warps`` warps, warp w owning row-blocks
    (blk * warps + w) * RB ... + RB - 1 over the block's K-slice of ``cps`` chunks.

    ``split`` (plan kind "split"): every warp of a block works on the same RB row-blocks, warp w
    taking chunks j0 + w, j0 + w + warps, ... of the K-slice, and the warps' partials meet in
    shared memory. The block stages the codebooks and its slice of x once, then walks row-groups
    blockIdx.x, blockIdx.x + gridDim.x, ... Why: at small and mid layers the gather grid gave each
    block a handful of chunks, so every block paid a 64-128 KiB codebook staging (or L1 misses to
    L2 a lookup) and the K-slices met through global memory and a counter, for a few microseconds
    of work (1024 x 1024: 8.3 us against fp16's 4.4; NOTES "Residual run 5").

    Arguments: x32 (B, in/2) int32 view of fp16 x; tiled int32 words; mainq (Nm*4,) and resq
    (Nr*4,) int32 views of the fp16 codebooks; sc32, bi32 int32 views of scale and bias (any
    4 words without a norm); y (B, out) fp16; ws (ksplit, B, rbs*32) fp32; counters (row-groups,)
    int32; n_out; rbs; nchunks; cps.

    ``rc``: copies of the residual codebook in shared memory (see below; the split plans use 2-8).

    ``lanes`` S (split, RB = 1, one K-slice): a warp's lanes split into S groups of 32 / S rows,
    group h taking chunk j + h of each of the warp's steps of S chunks; the groups' sums meet in
    shared memory with the warps'. A row-group is then 32 / S rows, so a layer of few rows gives S
    times the blocks, each with 1 / S of the gathers, without a K-split's finish through global
    memory (at 1024 outputs the row-groups of 32 fill only 32 SMs; NOTES session 41). Each chunk of
    x is padded by 16 bytes so that the groups' reads of x fall in different banks.
    """
    if lanes != 1 and (lanes not in LANE_SPLITS or not split or RB != 1):
        raise ValueError(f"a lane split takes {LANE_SPLITS[1:]} lane groups in the split kernel at RB = 1; "
                         f"got lanes={lanes}, split={split}, RB={RB}")
    key = ("residual", Nm, Nr, B, warps, RB, main_shared, norm, split, rc, lanes)
    if key in _kernel_cache:
        return _kernel_cache[key]

    bm, br = index_bits(Nm, Nr)
    WPC = bm + br  # words a chunk of one row
    FMASK, MMASK, BM, TWO = uint32((1 << WPC) - 1), uint32(Nm - 1), uint32(bm), uint32(2)
    nreg = RB * WPC
    nt = warps * 32
    nacc = RB * B
    _check_copies(rc)
    # ``rc`` copies of the residual codebook, interleaved (entry e's copy c at 16 * (e * rc + c) bytes), lane l
    # reading copy l % rc: at rc = 8 the 8 lanes of a 16-byte load's phase read 8 distinct bank groups whatever
    # their entries, 4 wavefronts a warp against ~10 for random entries in one copy.
    RCM, RSH = uint32(rc - 1), uint32(2 + rc.bit_length() - 1)
    res_words, main_words = Nr * 4 * rc, Nm * 4
    # Dynamic shared memory (4-byte units): [main codebook if staged][residual codebook(s)][B x slice of x].
    # Everything read 16 bytes at a time lives there: its base is 16-byte aligned, a static array's need not be.
    # With ``split``, the warps' partials follow x: (warps x RB x B) x 32 fp32 at XOFF + B x the slice's columns.
    ROFF = main_words if main_shared else 0
    XOFF = ROFF + res_words
    S, PAD = lanes, (X_PAD if lanes > 1 else 0)
    RL = 32 // S  # rows a lane group
    LSH = uint32(RL.bit_length() - 1)
    STEP = warps * S if split else 1  # chunks between a warp's consecutive steps
    bpart_size = B * nt if norm else 1
    bred_size = B * 32 if norm else 1
    ring_size, wv_size = 2 * nreg, 8 * RB  # local array sizes must be literals
    stage_x, finish, add_bias_dot, _ = _common_device_functions(B, nt, RB, norm, PAD)

    @cuda.jit(device=True, **INLINE)
    def vec(ring, s, j, sh, straddle, i, mainq, dyn_i, xs, xo, ncols, acc, wv):
        # Vector i of the chunk in ring slot s: its field starts at bit sh of word j.
        for r in range(RB):
            o = s + r * WPC + j
            lo = uint32(ring[o])
            if straddle:
                f = (lo >> uint32(sh)) | (uint32(ring[o + 1]) << uint32(32 - sh))
            else:
                f = lo >> uint32(sh)
            f = f & FMASK
            im = (f & MMASK) << TWO
            ir = ((f >> BM) << RSH) + ((uint32(cuda.laneid) & RCM) << TWO)
            if main_shared:
                m0, m1, m2, m3 = sload4(dyn_i, im)
            else:
                m0, m1, m2, m3 = load16(mainq, im)
            q0, q1, q2, q3 = sload4(dyn_i, ROFF + ir)
            # Summed as fp16 pairs, rounded once as a dequantized fp16 weight is: 18 % fewer instructions
            # than converting both and adding in fp32, 1-9 % faster (H100; the kernel is bound by the
            # gathers' shared-memory wavefronts, NOTES session 30).
            k = 8 * r
            wv[k], wv[k + 1] = hadd2_to_float2(m0, q0)
            wv[k + 2], wv[k + 3] = hadd2_to_float2(m1, q1)
            wv[k + 4], wv[k + 5] = hadd2_to_float2(m2, q2)
            wv[k + 6], wv[k + 7] = hadd2_to_float2(m3, q3)
        xi = xo + 8 * i
        for bb in range(B):
            x0, x1, x2, x3 = sload4(xs, xi + bb * ncols)
            x4, x5, x6, x7 = sload4(xs, xi + bb * ncols + 4)
            for r in range(RB):
                k = 8 * r
                t = cuda.fma(wv[k + 3], x3, cuda.fma(wv[k + 2], x2, cuda.fma(wv[k + 1], x1, cuda.fma(wv[k], x0, acc[r * B + bb]))))
                acc[r * B + bb] = cuda.fma(wv[k + 7], x7, cuda.fma(wv[k + 6], x6, cuda.fma(wv[k + 5], x5, cuda.fma(wv[k + 4], x4, t))))

    ns = {"vec": vec, "int32": int32}
    exec(compile(_chunk_source(WPC), f"<residual chunk_dot b={WPC}>", "exec"), ns)
    chunk_dot = cuda.jit(device=True, **INLINE)(ns["chunk_dot"])

    load_words = _word_loader(RB, WPC, lanes)

    @cuda.jit(device=True)
    def fetch(dst, off, tiled, rb0, rbs, nchunks, j, j1):
        # j: the warp's step; a lane group's chunk is h = lane // (32 / S) past it (the planner makes S divide
        # the K-slice's chunks, so a step is whole)
        jl = j + (uint32(cuda.laneid) >> LSH) if S > 1 else j
        load_words(dst, off, WPC, tiled, rb0, rbs, nchunks, jl, 0, WPC, j < j1)

    # A split block is one an SM by design (it stages both codebooks): launch bounds let ptxas size its
    # registers for the whole block (unbounded, 32 warps at RB = 1 took 100 registers and could not launch).
    @cuda.jit(**({"launch_bounds": (nt, 1)} if split and not SIM else {}))
    def kernel(x32, tiled, mainq, resq_g, sc32, bi32, y, ws, counters, n_out, rbs, nchunks, cps, cbexp):  # (cbexp: the table kernel's)
        bpart = cuda.shared.array(bpart_size, float32)
        bred = cuda.shared.array(bred_size, float32)
        last = cuda.shared.array(1, int32)
        dyn_i = cuda.shared.array(0, int32)  # [main codebook if staged][residual codebook][B x slice of x, fp32]
        xs = cuda.shared.array(0, float32)  # the same memory (dynamic shared arrays alias)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        blk = cuda.blockIdx.x
        j0 = cuda.blockIdx.y * cps
        j1 = min(j0 + cps, nchunks)
        ncols = (j1 - j0) * CHUNK
        xstride = ncols + (j1 - j0) * PAD  # a batch row of x in shared memory
        jfirst = j0 + warp * S if split else j0
        hx = (lane >> LSH) * (CHUNK + PAD) if S > 1 else 0  # the lane group's chunk in x
        RED = XOFF + B * xstride

        # Start streaming this warp's first chunk before anything waits.
        ring = cuda.local.array(ring_size, int32)
        rb0 = blk * RB if split else (blk * warps + warp) * RB
        fetch(ring, 0, tiled, rb0, rbs, nchunks, jfirst, j1)

        # Codebooks -> shared as asynchronous copies: all of a thread's in flight at once, holding no
        # registers (staged through registers, 8 at a time, a 4-warp block waited 4 L2 round trips).
        # The rc copies of an entry read one L1 line (cp.async.ca). Copying them within shared memory after a
        # barrier instead measured 1.5 % slower over the grid (db8b5a8, reverted; NOTES session 31).
        for q in range(tid, res_words // 4, nt):
            copy16_async(dyn_i, ROFF + q * 4, resq_g, (q // rc) * 4)
        if main_shared:
            for q in range(tid, main_words // 4, nt):
                copy16_async(dyn_i, q * 4, mainq, q * 4)
        pb = cuda.local.array(B, float32)
        stage_x(x32, sc32, bi32, xs, XOFF, j0 * CHUNK, ncols, pb, tid)
        async_wait_all()
        cuda.syncthreads()

        acc = cuda.local.array(nacc, float32)
        wv = cuda.local.array(wv_size, float32)
        grp = blk
        ngroups = -(-rbs // RB) * S if split else blk + 1  # split blocks walk row-groups; gather blocks own one
        slot = 0  # the ring slot holding the chunk this warp uses next
        while grp < ngroups:
            for i in range(nacc):
                acc[i] = 0.0
            nxt = grp + cuda.gridDim.x
            j = jfirst
            while j < j1:
                # Refill the other slot with the warp's next chunk, then use this one. The next chunk
                # after a row-group's last is the first of the block's next row-group: a split warp
                # owns one or two chunks a row-group, so fetching it only after the group's finish
                # left every warp of the SM waiting a DRAM round trip a row-group.
                jn, rbn = j + STEP, rb0
                if jn >= j1:
                    jn, rbn = (jfirst if nxt < ngroups else j1), nxt * RB
                # Each branch names its slots as literals: a slot index ptxas cannot resolve puts the
                # ring in local memory (a 160-320 byte stack frame, measured).
                xo = XOFF + (j - j0) * (CHUNK + PAD) + hx
                if slot == 0:
                    fetch(ring, nreg, tiled, rbn, rbs, nchunks, jn, j1)
                    chunk_dot(ring, int32(0), mainq, dyn_i, xs, xo, xstride, acc, wv)
                else:
                    fetch(ring, 0, tiled, rbn, rbs, nchunks, jn, j1)
                    chunk_dot(ring, int32(nreg), mainq, dyn_i, xs, xo, xstride, acc, wv)
                slot = 1 - slot
                j += STEP
            if split:  # the warps' partials of these rows, summed by warp 0
                for i in range(nacc):
                    xs[RED + (warp * nacc + i) * 32 + lane] = acc[i]
                cuda.syncthreads()
                if warp == 0:
                    for i in range(nacc):
                        v = float32(0.0)
                        if S > 1:  # every warp's and lane group's sum of this lane's row
                            for w in range(warps):
                                for h in range(S):
                                    v += xs[RED + (w * nacc + i) * 32 + h * RL + (lane & (RL - 1))]
                            acc[i] = v
                        else:
                            for w in range(1, warps):
                                v += xs[RED + (w * nacc + i) * 32 + lane]
                            acc[i] += v
            if S > 1:  # one K-slice: lanes 0 .. 32 / S - 1 of warp 0 write the group's rows
                if norm:
                    add_bias_dot(acc, pb, bpart, bred, tid)
                row = grp * RL + lane
                if warp == 0 and lane < RL and row < n_out:
                    for bb in range(B):
                        y[bb, row] = acc[bb]
            else:
                finish(acc, pb, bpart, bred, last, y, ws, counters, grp, warp == 0 or not split, rb0, rbs, n_out, tid)
            if split:
                cuda.syncthreads()  # the partials' space is reused by the next row-group
            grp = nxt
            rb0 = grp * RB

    _kernel_cache[key] = kernel
    return kernel


def _step_head(nsteps: int, s: int, w_lo: int, nw: int, result: str = "") -> list[str]:
    """The generated chunk_steps' lines that open table step s of a chunk's ``nsteps``: its words
    w_lo .. w_lo + nw - 1 loaded (their latency behind the build), the table built between barriers;
    ``result``: what the build's return value is assigned to ("up = "), if anything."""
    return [f"    q = j * {nsteps} + {s}",
            "    if q >= q0 and q < q1:",
            f"        load_words(wreg, 0, WS, tiled, rb0, rbs, nchunks, j, int32({w_lo}), int32({nw}), True)",
            "        cuda.syncthreads()",
            f"        {result}build(tab, tabi, cbm, cbr, xv, (q - q0) * G8, ncols, tid, mainq, resq, cbexp)",
            "        cuda.syncthreads()"]


def _table_source(b: int, G: int) -> str:
    """chunk_steps: the table steps of one chunk, every word index and bit offset a constant (as int32(...):
    see :func:`_chunk_source`)."""
    lines = [CHUNK_STEPS_DEF]
    for s, (w_lo, nw, fields) in enumerate(_step_layout(b, G)):
        lines += _step_head(VECS_PER_CHUNK // G, s, w_lo, nw)
        lines += [f"        look(wreg, int32({rel}), int32({sh}), int32({int(st)}), int32({gi}), tab, acc)"
                  for gi, (rel, sh, st) in enumerate(fields)]
    return "\n".join(lines) + "\n"


CHUNK_STEPS_DEF = "def chunk_steps(j, q0, q1, ncols, wreg, tiled, rb0, rbs, nchunks, tab, tabi, cbm, cbr, xv, acc, tid, mainq, resq, cbexp):"


def _step_period(steps: list) -> tuple[int, int]:
    """The fewest steps P after which a chunk's step layouts repeat (the same fields and word counts, the
    words shifted by D each period), as (P, D); (len(steps), 0) when they do not repeat within the chunk.
    ``steps``: a step's (first word, words, fields) triples (:func:`_step_layout`) concatenated, one tuple a step."""
    def shifted(step, d):  # the step with every triple's first word d words on
        return tuple(v + d if k % 3 == 0 else v for k, v in enumerate(step))

    n = len(steps)
    for P in range(1, n):
        D = steps[P][0] - steps[0][0]
        if n % P == 0 and all(steps[i + P] == shifted(steps[i], D) for i in range(n - P)):
            return P, D
    return n, 0


def _banked_source(b: int, RB: int, G: int) -> str:
    """chunk_steps of the banked table (v6): steps of G vectors, every row's lookups unrolled (acc and wreg
    stay in registers); at G = 16 a step's fields are looked up in two halves (the words of G = 8 steps),
    so a row holds no more words than at G = 8: each row's second-half words load, into the first half's
    registers, as soon as that row's first half is looked up, behind the other rows' lookups.
    At G = 16, where the steps' field layouts repeat (20-bit fields: every step's words alike), one period's
    steps are written once, in a loop over the periods: half the SASS, and ncu's no-instruction stalls
    1.18 -> 0.06 a issued instruction, yet RB 7 as fast as unrolled and RB 8 1-3 % faster (H200, NOTES
    "Session 69"). G = 8 (22-bit fields repeat every second step) stays unrolled: its loop measured 0.2-0.6 %
    slower at RB 7, the plan the tuner picks there."""

    def looks(r, fields, i0=0):
        return [f"        look_row(wreg, {r}, int32({rel}), int32({sh}), int32({int(st)}), uint32({i0 + i}), tabi, acc, up)"
                for i, (rel, sh, st) in enumerate(fields)]

    nsteps = VECS_PER_CHUNK // G
    if G == 8:
        steps = _step_layout(b, 8)
    else:
        halves = _step_layout(b, G // 2)
        steps = [halves[2 * s] + halves[2 * s + 1] for s in range(nsteps)]
    P, D = _step_period(steps) if G == 16 else (nsteps, 0)
    w = (lambda c: f"{c} + {D} * p") if P < nsteps else str  # word offsets: constants, or shifted each period
    body = []
    for s in range(P):
        q = f"p * {P} + {s}" if P < nsteps else s
        if G == 8:
            w_lo, nw, fields = steps[s]
            body += _step_head(nsteps, q, w(w_lo), nw, "up = ")
            for r in range(RB):
                body += looks(r, fields)
            continue
        wa, na, fa, wb, nb, fb = steps[s]
        body += _step_head(nsteps, q, w(wa), na, "up = ")
        for r in range(RB):
            body += looks(r, fa)
            body += [f"        load_row(wreg, {r} * WS, tiled, rb0 + {r}, lane, rb0 + {r} < rbs, nchunks, j, int32({w(wb)}), int32({nb}))"]
        for r in range(RB):
            body += looks(r, fb, len(fa))
    lines = [CHUNK_STEPS_DEF] + (["    lane = uint32(cuda.laneid)"] if G != 8 else [])
    if P < nsteps:
        lines += [f"    for p in range({nsteps // P}):"] + ["    " + line for line in body]
    else:
        lines += body
    return "\n".join(lines) + "\n"


def residual_table_kernel(Nm: int, Nr: int, B: int, warps: int, RB: int, G: int, norm: bool, cb_shared: bool = False,
                          mma: bool = False, stamps: bool = False, fanin: int = 0, banked: bool = False, spread: bool = False):
    """The "table" residual-VQ GEMV (v2): lookups of dot products instead of codebook vectors.

    The K-slice of a block is walked in steps of G vectors (8G input columns). Each step, every
    thread of the block computes its share of the table T[b][g][c] = dot(x[b, group g], codebook
    entry c) for the G groups and every main and residual entry, then a lane's row costs one 4-byte
    table read per index and an add a vector: two shared loads where the gather kernel needed two
    16-byte gathers, eight conversions and eight multiply-adds a batch row. The table is
    B x G x (Nm + Nr) fp32 (64 KiB for 4096 + 256 at G = 4), so it is rebuilt for every step, and
    a block owns many rows (warps x RB x 32) to spread that cost.

    The main codebook is loaded once a block, into registers (Nm / threads entries a thread: ptxas
    keeps them converted to fp32, 8 registers an entry, so only up to 8 entries a thread fit) or,
    with ``cb_shared``, into shared memory (one 16-byte read an entry a step); the residual codebook
    always sits in registers.

    With ``mma`` (v3), the table is built on the tensor cores instead: T (entries x columns) =
    codebook (entries x 8) . X (8 x columns), a column per (batch row, group), one
    ``mma.m16n8k8`` for 16 entries x 8 columns. Both codebooks then sit in shared memory (the A
    fragments are two 4-byte reads a lane), x is rounded to fp16 for the B fragment (the products
    are exact in fp32), and a table row is padded by 4 words so that the 4 columns of a D
    fragment's stores fall 8 banks apart. The scalar build spends ~40 instructions a thread on an
    entry of two groups (SASS, v2.1); an mma covers 16 entries of 8 columns for ~17. Without
    ``cb_shared`` the A fragments are read from global memory (L1-resident: the same 70-139 KiB
    every step), which leaves shared memory to the table alone: two 8-warp blocks an SM at G <= 4.

    Grid (row-groups, K-slices); K-slices are ``sps`` steps long (not whole chunks: small layers
    spread over more SMs). The index words a step needs (at most ceil(8 G b / 32) + 1 a row)
    load before the step's table is built, so their latency hides behind the build.
    Arguments as :func:`residual_kernel`, with ``sps`` (steps a K-slice) in place of ``cps``.

    With ``banked`` (v6; batch 1, G in :data:`BANKED_GS`), the table is fp16 and laid out so that a
    warp's lookups conflict less: every 32 random 4-byte lookups of one group's table (v3) hit ~3.5
    distinct words in the busiest bank, so a warp's lookup took ~3.5 shared-memory wavefronts. Here
    group g's entries live in 32 / G banks of their own (at G = 16, entry e at byte (e / 4) * 128 + 8 g
    + (e % 4) * 2: four fp16 entries in two words a 128-byte row; at G = 8, eight entries in four
    words), and at slot i of a step lane l looks up group (i + l / (32 / G)) % G, so each group's banks
    serve only 32 / G lanes: ~2.0 wavefronts a lookup at G = 16, ~3.0 at G = 8. For that the
    words are stored skewed (:func:`skew_indices`: a row's vectors rotated by lane / (32 / G) within
    each run of G). The table is built with x as the mma's A operand (16 groups x 8 dimensions; at
    G = 8 the second 8 rows are zero) and the codebooks as B (8 entries a tile), so a lane's D fragment
    holds two adjacent entries of one group: one 4-byte store each. Entries are scaled by 2**-s where |x| times a codebook entry's L1 norm could
    leave fp16 (s from the step's max |x| and ``cbexp``, as in the additive kernel; 0 for ordinary
    activations), and the sums by 2**s; the scaling is applied to x before the mma, not to each entry after it.

    The K-split finish is the wide one of :func:`_common_device_functions`, in runs of ``fanin``, or with
    ``spread`` (one-wave grids only), spread over the row-group's blocks: each waits for all the K-slices'
    partials, then sums a 1 / K-split share of the rows (``spread_finish`` there).
    ``stamps`` (a timeline, see :meth:`ResidualGemv.timeline`): thread 0 of each block writes its
    SM, the GPU clock at its start, after its prologue (codebooks and x staged), after its last
    step and after its finish, and what it summed, into ``counters`` after the finish's counters.
    """
    key = ("residual-table", Nm, Nr, B, warps, RB, G, norm, cb_shared, mma, stamps, fanin, banked, spread)
    if key in _kernel_cache:
        return _kernel_cache[key]
    if banked and (B != 1 or G not in BANKED_GS or mma):
        raise ValueError(f"the banked table takes batch 1 and G in {BANKED_GS}, got batch {B}, G = {G}")
    if G not in TABLE_STEPS and not banked:
        raise ValueError(f"G (groups a table step) must be one of {TABLE_STEPS}, got {G}")
    bm, br = index_bits(Nm, Nr)
    WPC = bm + br
    layout = _step_layout(WPC, 8 if banked else G)  # (banked G = 16: looked up in halves, see _banked_source)
    WS = max(nw for _, nw, _ in layout)  # words a row a step (a half-step), at most
    nt = warps * 32
    nper = -(-Nm // nt)  # main entries a thread (registers: 4 words each)
    rper = -(-Nr // nt)
    TS = table_stride(Nm, Nr, mma)  # a (batch row, group)'s table
    both = mma or banked  # both codebooks in shared memory (or global: CBG), none in registers
    CBW = (4 * (Nm + Nr) if both else 4 * Nm) if cb_shared else 0  # [codebooks (fp16 pairs as int32) in shared][tables][x slice], 4-byte units
    CBG = both and not cb_shared  # mma codebook fragments straight from global memory
    XOFF = CBW + ((Nm + Nr) * G // 2 if banked else B * G * TS)
    MMASK4 = uint32((Nm - 1) << 2)
    RMASK4 = uint32((Nr - 1) << 2)
    RSHIFT = uint32(bm - 2)
    NMB = uint32(Nm * 4)
    bpart_size = B * nt if norm else 1
    bred_size = B * 32 if norm else 1
    cbm_size = 1 if cb_shared or both else 4 * nper  # local array sizes must be literals
    cbr_size = 1 if both else 4 * rper
    acc_size, wreg_size, xv_size = RB * B, RB * WS, 1 if both else 8 * G
    # banked: byte offsets of an entry's 16-bit slot (see above), from a field f = im | ir << bm: a group's
    # ES = 64 / G entries a 128-byte row, (im / ES) * 128 = (f << LS) & BHI_M, (im % ES) * 2 = (f << 1) & ELO
    ES = 64 // G if banked else 4
    LS = 7 - (ES.bit_length() - 1)
    BHI_M = uint32(((Nm - 1) << LS) & ~0x7F)
    BHI_R = uint32(((Nr - 1) << LS) & ~0x7F)
    ELO = uint32(2 * ES - 2)
    GSH = uint32(5 - (G.bit_length() - 1)) if banked else uint32(1)  # lane >> GSH: the lane's group offset
    TB, TBR = CBW * 4, CBW * 4 + 2 * G * Nm  # the main and residual entries' first bytes
    NTB = (Nm + Nr) // 8  # banked: mma N-tiles of 8 entries
    WTILE = 256 * warps if G == 16 else 128 * warps  # banked: table bytes between a warp's consecutive N-tiles
    CTILE = 128 * warps  # banked: codebook bytes between them (8 entries of 16 bytes a tile)
    load_row = _row_loader(WPC)
    BG = B * G  # table columns
    NT = -(-BG // 8)  # mma N-tiles (8 columns each)
    NTILES = (Nm + Nr) // 16  # mma M-tiles (16 entries each)
    TPW = -(-NTILES // warps)  # M-tiles a warp
    mma_tile = mma_table_tile(NT, BG, TS)
    stage_x, finish, _, spread_finish = _common_device_functions(B, nt, RB, norm, wide=True, fanin=fanin, spread=spread)

    load_words = _word_loader(RB, WPC)

    @cuda.jit(device=True, **INLINE)
    def stamp(counters, k, v):
        if cuda.threadIdx.x == 0:  # after the finish's counters (see finish_sizes)
            base = finish_counters(cuda.gridDim.x, cuda.gridDim.y, fanin, spread)
            counters[base + STAMPS * (cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x) + k] = int32(v)

    @cuda.jit(device=True, **INLINE)
    def dot8(w0, w1, w2, w3, xv, g):
        c0, c1 = half2_to_float2(w0)
        c2, c3 = half2_to_float2(w1)
        c4, c5 = half2_to_float2(w2)
        c6, c7 = half2_to_float2(w3)
        o = 8 * g
        v = xv[o] * c0
        v = cuda.fma(xv[o + 1], c1, v)
        v = cuda.fma(xv[o + 2], c2, v)
        v = cuda.fma(xv[o + 3], c3, v)
        v = cuda.fma(xv[o + 4], c4, v)
        v = cuda.fma(xv[o + 5], c5, v)
        v = cuda.fma(xv[o + 6], c6, v)
        return cuda.fma(xv[o + 7], c7, v)

    @cuda.jit(device=True, **INLINE)
    def build(tab, tabi, cbm, cbr, xv, xo, ncols, tid, mainq, resq, cbexp):
        # This step's G groups of x (already scaled under a norm) into registers, once a batch row;
        # then thread tid writes entries tid, tid + nt, ...: consecutive lanes, consecutive banks.
        for bb in range(B):
            for g in range(G):
                o = XOFF + bb * ncols + xo + 8 * g
                xv[8 * g], xv[8 * g + 1], xv[8 * g + 2], xv[8 * g + 3] = sload4(tab, o)
                xv[8 * g + 4], xv[8 * g + 5], xv[8 * g + 6], xv[8 * g + 7] = sload4(tab, o + 4)
            for k in range(nper):
                c = uint32(tid + k * nt)  # unsigned, as in load_words
                if c < uint32(Nm):
                    if cb_shared:
                        w0, w1, w2, w3 = sload4(tabi, uint32(4) * c)
                    else:
                        w0, w1, w2, w3 = cbm[4 * k], cbm[4 * k + 1], cbm[4 * k + 2], cbm[4 * k + 3]
                    for g in range(G):
                        tab[uint32(CBW + (bb * G + g) * TS) + c] = dot8(w0, w1, w2, w3, xv, g)
            for k in range(rper):
                c = tid + k * nt
                if c < Nr:
                    for g in range(G):
                        tab[uint32(CBW + (bb * G + g) * TS + Nm + c)] = dot8(cbr[4 * k], cbr[4 * k + 1], cbr[4 * k + 2], cbr[4 * k + 3], xv, g)

    @cuda.jit(device=True, **INLINE)
    def fragment_lane(tid):
        # (g, t, warp) of an mma fragment: g = lane / 4, t = lane % 4
        lane = uint32(tid) & uint32(31)
        return lane >> uint32(2), lane & uint32(3), uint32(tid) >> uint32(5)

    @cuda.jit(device=True, **INLINE)
    def codebook_word(tabi, mainq, resq, e, t):
        # Word t (dimensions 2t, 2t + 1) of codebook entry e (main, then residual), from shared memory or,
        # with CBG, global memory (the caller keeps the branch warp-uniform).
        if not CBG:
            return tabi[uint32(4) * e + t]
        if e < uint32(Nm):
            return mainq[uint32(4) * e + t]
        return resq[uint32(4) * (e - uint32(Nm)) + t]

    @cuda.jit(device=True, **INLINE)
    def build_mma(tab, tabi, cbm, cbr, xv, xo, ncols, tid, mainq, resq, cbexp):
        # Lane (g, t) = (lane / 4, lane % 4). B fragment of N-tile n: column c = 8n + g, i.e. batch
        # row c / G, group c % G of the step, dimensions 2t and 2t + 1 (zero past the last column).
        # 32-bit unsigned arithmetic throughout: with int64 (numba's default) ptxas kept 64-bit
        # loop counters and recomputed the loop-invariant store predicates every tile.
        gl, t, warp = fragment_lane(tid)
        bx = cuda.local.array(NT, int32)
        for n in range(NT):
            c = uint32(8 * n) + gl
            bx[n] = 0
            if c < uint32(BG):
                o = uint32(XOFF) + (c // uint32(G)) * uint32(ncols) + uint32(xo) + uint32(8) * (c % uint32(G)) + uint32(2) * t
                bx[n] = float2_to_half2(tab[o], tab[o + uint32(1)])
        e = uint32(16) * warp + gl
        for k in range(TPW):
            if e < uint32(Nm + Nr):  # the same for the whole warp (e - gl is a multiple of 16): mma needs all 32 lanes
                # (main or residual: also warp-uniform, Nm is a multiple of 16)
                a0 = codebook_word(tabi, mainq, resq, e, t)
                a1 = codebook_word(tabi, mainq, resq, e + uint32(8), t)
                mma_tile(tab, uint32(CBW), e, t, a0, a1, bx, float32(1.0))
            e += uint32(16 * warps)

    @cuda.jit(device=True, **INLINE)
    def build_tile(tabi, w, a0, a1, b):
        # One N-tile of the banked build: D's two fp16 pairs stored at byte w of the table (and w + 64: G = 16, groups g + 8).
        d0, d1, d2, d3 = mma_m16n8k8(a0, a1, b)
        store_byte_offset(tabi, w, float2_to_half2(d0, d1))
        if G == 16:
            store_byte_offset(tabi, w + uint32(64), float2_to_half2(d2, d3))

    @cuda.jit(device=True, **INLINE)
    def build_tiles(cbw, tabi, n, n1, cb, w, a0, a1):
        # The banked build's N-tiles n, n + warps, ... below n1: B = the codebook word at byte cb of cbw (shared
        # or global), stored at byte w of the table.
        while n < n1:  # warp-uniform: mma needs all 32 lanes
            build_tile(tabi, w, a0, a1, load_byte_offset(cbw, cb))
            n += uint32(warps)
            cb += uint32(CTILE)
            w += uint32(WTILE)
        return n, cb, w

    @cuda.jit(device=True, **INLINE)
    def build_tiles_global(cbw, tabi, n, n1, cb, w, a0, a1):
        # As build_tiles, with cbw in global memory (the 8-group table at 8192 centroids): each tile's B word is an
        # L2 round trip, and ptxas's own unroll of build_tiles kept 4 of them in flight a warp (ncu, warm: long
        # scoreboard 2.69 stalls a issued instruction). So BUILD_UNROLL tiles' loads go out before their mmas.
        while n + uint32((BUILD_UNROLL - 1) * warps) < n1:
            b = cuda.local.array(BUILD_UNROLL, int32)
            for u in range(BUILD_UNROLL):
                b[u] = load_byte_offset(cbw, cb + uint32(u * CTILE))
            for u in range(BUILD_UNROLL):
                build_tile(tabi, w + uint32(u * WTILE), a0, a1, b[u])
            n += uint32(BUILD_UNROLL * warps)
            cb += uint32(BUILD_UNROLL * CTILE)
            w += uint32(BUILD_UNROLL * WTILE)
        return build_tiles(cbw, tabi, n, n1, cb, w, a0, a1)

    @cuda.jit(device=True, **INLINE)
    def build_banked(tab, tabi, cbm, cbr, xv, xo, ncols, tid, mainq, resq, cbexp):
        # Lane (g, t): A fragments = dimensions 2t, 2t + 1 of groups g and g + 8 of the step; B fragment
        # of N-tile n = word t of entry 8n + g; D = groups g, g + 8 x entries 8n + 2t, 8n + 2t + 1, the
        # adjacent halves of one word in the group's banks. Returns the sums' factor 2**s.
        gl, t, warp = fragment_lane(tid)
        o = uint32(XOFF) + uint32(xo) + uint32(8) * gl + uint32(2) * t
        a0 = float2_to_half2(tab[o], tab[o + uint32(1)])
        a1 = float2_to_half2(tab[o + uint32(64)], tab[o + uint32(65)]) if G == 16 else int32(0)
        # Every warp holds the step's whole x, so each finds the same s alone.
        up, down = fp16_table_scale(half2_abs_bits(half2_abs_bits(uint32(0), a0), a1), cbexp, FP16_HEADROOM)
        if down != float32(1.0):
            # (Rounded again from the fp32 x. Scaling the fp16 fragments instead, as the additive stream kernel
            # does, gives the same values, but ptxas then compiled this kernel 7 % longer: 5896 SASS instructions
            # against 5520, 506 more IMAD.IADD among them; CUDA 13, sm_90.)
            a0 = float2_to_half2(tab[o] * down, tab[o + uint32(1)] * down)
            if G == 16:
                a1 = float2_to_half2(tab[o + uint32(64)] * down, tab[o + uint32(65)] * down)
        # Byte offsets of this lane's codebook word and table word for its warp's first N-tile, each advanced by a
        # constant a tile, in 32-bit arithmetic: indexing (64-bit in numba) and recomputing them from n made
        # ptxas spend ~38 instructions a tile (sm_90), the lane's fragment position recomputed every tile.
        cb = (uint32(32) * warp + uint32(4) * gl + t) * uint32(4)  # word t of entry 8n + g of the codebooks' words
        if G == 16:  # word (e / 4) * 32 + 2 g + (e / 2) % 2 of entry e = 8n + 2t, group g = gl and gl + 8
            w = (uint32(CBW) + (uint32(2) * warp + (t >> uint32(1))) * uint32(32) + uint32(2) * gl + (t & uint32(1))) * uint32(4)
        else:  # word (e / 8) * 32 + 4 g + (e / 2) % 4: a warp's 32 stores, 32 consecutive words
            w = (uint32(CBW) + warp * uint32(32) + uint32(4) * gl + t) * uint32(4)
        if not CBG:
            build_tiles(tabi, tabi, warp, uint32(NTB), cb, w, a0, a1)
        else:  # codebooks in global memory: the main tiles, then the residual ones (a loop each: no pointer select a tile)
            n, cb, w = build_tiles_global(mainq, tabi, warp, uint32(Nm // 8), cb, w, a0, a1)
            build_tiles_global(resq, tabi, n, uint32(NTB), cb - uint32(16 * Nm), w, a0, a1)
        return up

    @cuda.jit(device=True, **INLINE)
    def look_row(wreg, r, q, sh, straddle, i, tabi, acc, up):
        # Slot i of the step: this lane's field there is group (i + lane / 2) % 16's (skewed words).
        gb = uint32(uint32(uint32(i + (uint32(cuda.laneid) >> GSH)) & uint32(G - 1)) * uint32(2 * ES))
        lo = uint32(wreg[r * WS + q])
        if straddle:
            f = uint32(uint32(lo >> uint32(sh)) | uint32(uint32(wreg[r * WS + q + 1]) << uint32(32 - sh)))
        else:
            f = uint32(lo >> uint32(sh))
        # (uint32 after each shift: numba widens uint32 arithmetic to 64 bits, and ptxas kept it)
        om = (uint32(f << uint32(LS)) & BHI_M) | (uint32(f << uint32(1)) & ELO) | gb
        orr = (uint32(f >> uint32(bm - LS)) & BHI_R) | (uint32(f >> uint32(bm - 1)) & ELO) | gb
        v = load_half_byte_offset(tabi, uint32(TB) + om) + load_half_byte_offset(tabi, uint32(TBR) + orr)
        acc[r] = cuda.fma(v, up, acc[r])

    @cuda.jit(device=True, **INLINE)
    def look(wreg, q, sh, straddle, gi, tab, acc):
        # Vector gi of the step: its field starts at bit sh of the step's word q.
        for r in range(RB):
            lo = uint32(wreg[r * WS + q])
            if straddle:
                f = (lo >> uint32(sh)) | (uint32(wreg[r * WS + q + 1]) << uint32(32 - sh))
            else:
                f = lo >> uint32(sh)
            om = (f << uint32(2)) & MMASK4  # byte offsets of the two table entries
            orr = (f >> RSHIFT) & RMASK4
            for bb in range(B):
                base = uint32((CBW + (bb * G + gi) * TS) * 4)
                acc[r * B + bb] += load_byte_offset(tab, base + om) + load_byte_offset(tab, base + NMB + orr)

    ns = {"cuda": cuda, "load_words": load_words, "load_row": load_row, "look": look, "look_row": look_row,
          "build": build_banked if banked else build_mma if mma else build, "G8": 8 * G, "WS": WS, "RB": RB,
          "int32": int32, "uint32": uint32}
    src = _banked_source(WPC, RB, G) if banked else _table_source(WPC, G)
    exec(compile(src, f"<residual chunk_steps b={WPC} G={G} banked={banked}>", "exec"), ns)
    chunk_steps = cuda.jit(device=True, **INLINE)(ns["chunk_steps"])
    spc = VECS_PER_CHUNK // G

    # 128 registers a thread whatever the block size: one 16-warp block, or two 8-warp blocks, an SM
    @cuda.jit(**({} if SIM else {"launch_bounds": (nt, max(1, 512 // nt))}))
    def kernel(x32, tiled, mainq, resq, sc32, bi32, y, ws, counters, n_out, rbs, nchunks, sps, cbexp):
        bpart = cuda.shared.array(bpart_size, float32)
        bred = cuda.shared.array(bred_size, float32)
        last = cuda.shared.array(1, int32)
        tab = cuda.shared.array(0, float32)  # [main codebook if shared][B][G][Nm + Nr] table, then the B x K-slice of x
        tabi = cuda.shared.array(0, int32)  # the same memory
        tid = cuda.threadIdx.x
        if stamps:  # (a constant: no clock reads in the kernel otherwise)
            stamp(counters, 1, global_timer_lo())
        warp = tid // 32
        rb0 = (cuda.blockIdx.x * warps + warp) * RB
        nsteps = nchunks * spc
        q0 = cuda.blockIdx.y * sps
        q1 = min(q0 + sps, nsteps)

        # The codebooks, once a block: entry c = tid + k * nt is thread tid's k-th. The mma build
        # keeps both in shared memory, main then residual (entry e is the table's column e), or
        # reads them from global memory (CBG); the scalar build keeps the residual in registers.
        cbm = cuda.local.array(cbm_size, int32)
        for k in range(0 if CBG else nper):
            c = tid + k * nt
            if c < Nm:
                w0, w1, w2, w3 = load16(mainq, 4 * c)
                if cb_shared:
                    tabi[4 * c], tabi[4 * c + 1], tabi[4 * c + 2], tabi[4 * c + 3] = w0, w1, w2, w3
                else:
                    cbm[4 * k], cbm[4 * k + 1], cbm[4 * k + 2], cbm[4 * k + 3] = w0, w1, w2, w3
        cbr = cuda.local.array(cbr_size, int32)
        for k in range(0 if CBG else rper):
            c = tid + k * nt
            if c < Nr:
                w0, w1, w2, w3 = load16(resq, 4 * c)
                if both:
                    e = 4 * (Nm + c)
                    tabi[e], tabi[e + 1], tabi[e + 2], tabi[e + 3] = w0, w1, w2, w3
                else:
                    cbr[4 * k], cbr[4 * k + 1], cbr[4 * k + 2], cbr[4 * k + 3] = w0, w1, w2, w3

        pb = cuda.local.array(B, float32)
        ncols = (q1 - q0) * 8 * G
        stage_x(x32, sc32, bi32, tab, XOFF, q0 * 8 * G, ncols, pb, tid)
        # (the first step's barrier orders these stores before any read)
        if stamps:
            stamp(counters, 2, global_timer_lo())

        acc = cuda.local.array(acc_size, float32)
        for i in range(acc_size):
            acc[i] = 0.0
        wreg = cuda.local.array(wreg_size, int32)
        xv = cuda.local.array(xv_size, float32)
        j = q0 // spc
        while j * spc < q1:
            chunk_steps(j, q0, q1, ncols, wreg, tiled, rb0, rbs, nchunks, tab, tabi, cbm, cbr, xv, acc, tid, mainq, resq, cbexp)
            j += 1
        if stamps:
            stamp(counters, 3, global_timer_lo())
        level = finish(acc, pb, bpart, bred, last, y, ws, counters, cuda.blockIdx.x, True, rb0, rbs, n_out, tid)
        if spread and cuda.gridDim.y > 1:
            level = spread_finish(ws, y, counters, tab, cuda.blockIdx.x, rbs, n_out, tid)
        if stamps:
            stamp(counters, 4, global_timer_lo())
            stamp(counters, 0, sm_id())
            stamp(counters, 5, level if cuda.gridDim.y > 1 else 2)

    _kernel_cache[key] = kernel
    return kernel


# -- host side -------------------------------------------------------------------------------
MAIN_PLACEMENTS = ("shared", "global")


KINDS = ("table", "gather", "split")


@dataclass
class ResidualPlan:
    warps: int
    ksplit: int
    cps: int  # gather: chunks a K-slice; table: table steps a K-slice (G vectors a step)
    RB: int  # row-blocks a warp
    main: str  # gather: "shared" (staged by every block) or "global" (read through L1); table: "registers"
    shared_bytes: int  # dynamic shared memory (see plan_residual / plan_table)
    static_bytes: int
    kind: str = "gather"
    G: int = 0  # table: groups a step
    build: str = ""  # table: "fma" (scalar multiply-adds), "mma" (tensor cores, v3) or "banked" (fp16, bank-partitioned, v6)
    fanin: int = 0  # table: K-slices a level-one sum of the finish (0: one level; see _common_device_functions)
    blocks: int = 0  # split: blocks along the rows, each walking row-groups (0: one a row-group)
    rc: int = 1  # split: copies of the residual codebook in shared memory (see residual_kernel)
    lanes: int = 1  # split: lane groups a warp (row-groups of 32 / lanes rows; see residual_kernel)
    spread: bool = False  # table: the K-split finish spread over a row-group's blocks (see _common_device_functions)

    def overrides(self) -> dict:
        """The keyword arguments of :func:`plan_residual` that rebuild this plan (for ``ResidualGemv(plan=...)``)."""
        d = dict(kind=self.kind, warps=self.warps, RB=self.RB, ksplit=self.ksplit, main=self.main)
        return d | ({"G": self.G, "build": self.build} | ({"fanin": self.fanin} if self.fanin else {})
                    | ({"spread": True} if self.spread else {}) if self.kind == "table" else {}) | (
            {"blocks": self.blocks, "rc": self.rc} | ({"lanes": self.lanes} if self.lanes > 1 else {}) if self.kind == "split" else {})

    def groups(self, rbs: int) -> int:
        """Row-groups (one K-split counter each): RB row-blocks a group for split blocks (times the lane
        groups), warps x RB otherwise."""
        if self.kind == "split":
            return -(-rbs // self.RB) * self.lanes
        return -(-rbs // (self.RB * self.warps))

    def grid(self, rbs: int) -> tuple[int, int]:
        return (self.blocks if self.kind == "split" else self.groups(rbs)), self.ksplit


def _static_bytes(Nr: int, B: int, warps: int, norm: bool) -> int:
    return 16 + ((B * warps * 32 + B * 32) * 4 if norm else 0)


def shared_budget(device) -> int:
    return OPTIN_SIM if SIM else max_shared_bytes(device)


def _grow_ksplit(plan, ksplit: int, nchunks: int) -> "ResidualPlan":
    """``plan(ksplit)`` at the heuristic's K-split, or where that does not fit the block's shared memory,
    at the next larger one that does (doubling): a small budget (99 KiB a block on sm_86 / sm_89) cannot
    hold a long K-slice of x beside the codebooks. The error is the largest K-split's."""
    while True:
        try:
            return plan(ksplit)
        except ValueError:
            if ksplit >= nchunks:
                raise
            ksplit = min(nchunks, 2 * ksplit)


def plan_residual(n_out: int, nchunks: int, Nm: int, Nr: int, B: int, sms: int, norm: bool = False, budget: int = OPTIN_SIM,
                  warps: int | None = None, RB: int | None = None, ksplit: int | None = None, main: str | None = None,
                  kind: str | None = None, G: int | None = None, build: str | None = None,
                  blocks: int | None = None, rc: int | None = None, lanes: int | None = None,
                  fanin: int | None = None, spread: bool | None = None) -> ResidualPlan:
    """Grid shape for one layer. ``kind`` picks the kernel: "table" (:func:`residual_table_kernel`,
    the default up to batch :data:`TABLE_MAX_BATCH`) or "gather" (:func:`residual_kernel`).

    Gather, without overrides: 4 warps, RB = 2 for batches up to 4, a K-split giving about two
    blocks an SM, and the main codebook staged in shared memory only where a block streams enough
    vectors to repay the staging. :meth:`ResidualGemv.tune` times candidates instead."""
    if kind is None and (G is not None or main == "registers" or build is not None):
        kind = "table"
    if kind is None and main is None and B <= TABLE_MAX_BATCH:  # the table kernel where its table fits
        try:
            return plan_table(n_out, nchunks, Nm, Nr, B, sms, norm, budget, warps=warps, RB=RB, ksplit=ksplit)
        except ValueError:
            pass
    kind = kind or "gather"  # main="shared" or "global" alone names the gather kernel's placement
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind != "split" and (blocks is not None or rc is not None or lanes is not None):
        raise ValueError("blocks, rc and lanes are split-kernel options")
    if kind == "table":
        return plan_table(n_out, nchunks, Nm, Nr, B, sms, norm, budget, warps=warps, RB=RB, ksplit=ksplit, G=G, main=main,
                          build=build, fanin=fanin, spread=spread)
    if G is not None or build is not None or fanin is not None or spread is not None:
        raise ValueError("G (groups a table step), build, fanin and spread are table-kernel options")
    if kind == "split":
        return plan_split(n_out, nchunks, Nm, Nr, B, sms, norm, budget, warps=warps, RB=RB, ksplit=ksplit, blocks=blocks, rc=rc, lanes=lanes,
                          main=main)
    warps = warps or 4
    RB = RB or (2 if B <= 4 else 1)
    if warps not in (1, 2, 4, 8) or RB not in (1, 2):
        raise ValueError(f"warps must be 1, 2, 4 or 8 and RB 1 or 2, got warps={warps}, RB={RB}")
    rbs = -(-n_out // ROW_BLOCK)
    groups = -(-rbs // (warps * RB))
    static = _static_bytes(Nr, B, warps, norm)
    if static > STATIC_LIMIT:
        raise ValueError(f"batch {B} with {warps} warps needs {static} bytes of static shared memory (> {STATIC_LIMIT})")
    if ksplit is None:
        return _grow_ksplit(lambda ks: plan_residual(n_out, nchunks, Nm, Nr, B, sms, norm, budget, warps=warps, RB=RB,
                                                     ksplit=ks, main=main, kind="gather"),
                            max(1, min(nchunks, math.ceil(2 * sms / groups))), nchunks)
    if not 1 <= ksplit:
        raise ValueError(f"ksplit must be positive, got {ksplit}")
    cps = math.ceil(nchunks / min(ksplit, nchunks))
    ksplit = math.ceil(nchunks / cps)

    def dyn_bytes(main):
        return (Nm * 16 if main == "shared" else 0) + Nr * 16 + B * cps * CHUNK * 4

    if main is None:
        vectors_per_block = warps * RB * ROW_BLOCK * cps * VECS_PER_CHUNK
        main = "shared" if vectors_per_block >= 16 * Nm and static + dyn_bytes("shared") <= budget else "global"
    if main not in MAIN_PLACEMENTS:
        raise ValueError(f"main must be one of {MAIN_PLACEMENTS}, got {main!r}")
    dyn = dyn_bytes(main)
    if static + dyn > budget:
        raise ValueError(f"plan needs {static + dyn} bytes of shared memory (main {main}, {cps} chunks of x a block, "
                         f"batch {B}); the block may use {budget}: raise ksplit or place main in global memory")
    return ResidualPlan(warps, ksplit, cps, RB, main, dyn, static)


RES_COPIES = (1, 2, 4, 8)  # copies of the residual codebook a split block may keep (see residual_kernel)
LANE_SPLITS = (1, 2, 4)  # lane groups a warp of the split kernel (see residual_kernel)
X_PAD = 4  # floats after each chunk of x in shared memory under a lane split: the groups' x reads in distinct banks


def _check_copies(rc: int) -> None:
    if rc not in RES_COPIES:
        raise ValueError(f"rc (copies of the residual codebook) must be one of {RES_COPIES}, got {rc}")


def split_bytes(Nm: int, Nr: int, B: int, warps: int, RB: int, cps: int, rc: int = 1, lanes: int = 1) -> int:
    """Dynamic shared memory of a split block: the main codebook, rc copies of the residual one, B rows
    of its K-slice of x (fp32; padded after each chunk under a lane split), and the warps' partials
    (warps x RB x B x 32 fp32)."""
    return 16 * (Nm + rc * Nr) + 4 * B * cps * (CHUNK + (X_PAD if lanes > 1 else 0)) + 4 * warps * RB * B * 32


def plan_split(n_out: int, nchunks: int, Nm: int, Nr: int, B: int, sms: int, norm: bool = False, budget: int = OPTIN_SIM,
               warps: int | None = None, RB: int | None = None, ksplit: int | None = None, blocks: int | None = None,
               main: str | None = None, rc: int | None = None, lanes: int | None = None) -> ResidualPlan:
    """Split-kernel plan (:func:`residual_kernel` with ``split``). Without overrides: RB = 1, as many
    warps (up to 16, 8 at RB = 2) as the K-slice has chunks, a K-split only where the row-groups cannot give
    every SM a block, one block an SM walking the row-groups, and as many copies of the residual
    codebook (up to 8) as fit. ``lanes`` S > 1: a lane split (RB = 1, one K-slice, S dividing the
    chunks), warps enough for a step of S chunks each."""
    lanes = lanes or 1
    if lanes != 1:
        if lanes not in LANE_SPLITS:
            raise ValueError(f"lanes (lane groups a warp) must be one of {LANE_SPLITS}, got {lanes}")
        if RB not in (None, 1) or ksplit not in (None, 1) or nchunks % lanes:
            raise ValueError(f"a lane split of {lanes} takes RB = 1, one K-slice and a number of chunks it divides; "
                             f"got RB={RB}, ksplit={ksplit}, {nchunks} chunks")
        ksplit = 1
    if main not in (None, "shared"):
        raise ValueError(f"the split kernel stages both codebooks in shared memory: main must be 'shared', got {main!r}")
    RB = RB or 1
    if RB not in (1, 2):
        raise ValueError(f"RB must be 1 or 2, got {RB}")
    rbs = -(-n_out // ROW_BLOCK)
    groups = -(-rbs // RB) * lanes
    if ksplit is None:
        return _grow_ksplit(lambda ks: plan_split(n_out, nchunks, Nm, Nr, B, sms, norm, budget, warps=warps, RB=RB,
                                                  ksplit=ks, blocks=blocks, main=main, rc=rc),
                            max(1, min(nchunks, sms // groups)), nchunks)
    if not 1 <= ksplit:
        raise ValueError(f"ksplit must be positive, got {ksplit}")
    cps = math.ceil(nchunks / min(ksplit, nchunks))
    ksplit = math.ceil(nchunks / cps)
    # Registers (ptxas, sm_90): 100 a thread at RB = 1 and 148 at RB = 2 unbounded; capped for 32 (16)
    # warps they spill 0.3-0.6 KB a thread. So at most 16 warps at RB = 1 and 8 at RB = 2.
    wmax = 16 if RB == 1 else 8
    warps = warps or min(wmax, 1 << (-(-cps // lanes) - 1).bit_length())
    if warps not in (1, 2, 4, 8, 16) or warps > wmax:
        raise ValueError(f"warps must be a power of two from 1 to {wmax} at RB = {RB}, got {warps}")
    blocks = blocks or min(groups, max(1, sms // ksplit))
    if not 1 <= blocks <= groups:
        raise ValueError(f"blocks must be 1..{groups} (the row-groups), got {blocks}")
    static = _static_bytes(Nr, B, warps, norm)
    if static > STATIC_LIMIT:
        raise ValueError(f"batch {B} with {warps} warps needs {static} bytes of static shared memory (> {STATIC_LIMIT})")
    if rc is not None:
        _check_copies(rc)
    else:
        fit = [c for c in RES_COPIES if static + split_bytes(Nm, Nr, B, warps, RB, cps, c, lanes) <= budget]
        rc = fit[-1] if fit else 1
    dyn = split_bytes(Nm, Nr, B, warps, RB, cps, rc, lanes)
    if static + dyn > budget:
        raise ValueError(f"plan needs {static + dyn} bytes of shared memory (both codebooks, {cps} chunks of x, batch {B}); "
                         f"the block may use {budget}: " + ("a lane split keeps one K-slice" if lanes > 1 else "raise ksplit"))
    return ResidualPlan(warps, ksplit, cps, RB, "shared", dyn, static, kind="split", blocks=blocks, rc=rc, lanes=lanes)


# Row-blocks a warp in the table kernel (RB = 8 at 16 warps: 128 registers, no spills). 7: row-groups of 3584
# rows at 16 warps, which divide 14336 and 28672 (4 and 8 groups: 128 blocks with a K-split of 32 and 16
# where RB = 8 makes 4 groups, the last half empty, or 7, 112 blocks on 132 SMs).
TABLE_RB = (1, 2, 4, 7, 8)
TABLE_MAX_BATCH = 4  # the table is B x G x (Nm + Nr) fp32: past this the gather kernel is the default


TABLE_PLACEMENTS = ("registers", "shared")  # where the table kernel keeps the main codebook


# "banked" (v6): fp16 tables of G in BANKED_GS groups, each group's entries in banks of its own (see
# residual_table_kernel), batch 1 only. G = 8 where 16 groups' tables do not fit (8192 centroids).
TABLE_BUILDS = ("fma", "mma", "banked")
BANKED_GS = (16, 8)
BUILD_UNROLL = 8  # banked build from global memory: the tiles whose codebook loads a warp has in flight at once (16 spilled)


def table_stride(Nm: int, Nr: int, mma: bool) -> int:
    """4-byte words a (batch row, group)'s table: Nm + Nr entries, plus 4 of padding under the mma
    build (Nm + Nr is a multiple of 32, so without it the 4 columns a D fragment stores would hit one bank)."""
    return Nm + Nr + (4 if mma else 0)


def table_bytes(Nm: int, Nr: int, B: int, G: int, steps: int, main: str = "registers", build: str = "fma") -> int:
    """Dynamic shared memory of a table-kernel block: the codebooks held in shared memory (the main
    one if ``main`` is "shared"; both under the mma build), the tables, then the K-slice of x (fp32)."""
    mma = build == "mma"
    both = build in ("mma", "banked")
    cb = (16 * (Nm + Nr) if both else 16 * Nm) if main == "shared" else 0
    tables = 2 * G * (Nm + Nr) if build == "banked" else 4 * B * G * table_stride(Nm, Nr, mma)
    return cb + tables + 4 * B * steps * 8 * G


def plan_table(n_out: int, nchunks: int, Nm: int, Nr: int, B: int, sms: int, norm: bool = False, budget: int = OPTIN_SIM,
               warps: int | None = None, RB: int | None = None, ksplit: int | None = None, G: int | None = None,
               main: str | None = None, build: str | None = None, fanin: int | None = None,
               spread: bool | None = None) -> ResidualPlan:
    """Table-kernel plan. Without overrides: 16 warps, the main codebook in shared memory, RB up to
    8 row-blocks a warp (4096 rows a block share each table: building a table costs (Nm + Nr) x 8
    multiply-adds a step, so a vector-row pays (Nm + Nr) x 8 / rows of them; at RB = 2 that was 34,
    as much as the gather kernel's whole vector), G = 2 groups a step (fewer where a batch's tables
    do not fit), and a K-split, in steps, that gives about one wave of blocks (one 512-thread block
    of 128 registers fills an SM's register file).

    ``build="mma"`` (v3) builds the table on the tensor cores: both codebooks in shared memory, and
    by default the largest G up to 8 whose tables fit (an mma makes 8 table columns, B x G of them
    a step, so small G wastes most of it). ``fanin``: the K-split finish in two levels (see
    :func:`_common_device_functions`); by default one. ``build="banked"`` (v6, batch 1): fp16 tables of
    16 groups a step, bank-partitioned, on the tensor cores (see :func:`residual_table_kernel`).
    ``spread``: the finish spread over the row-group's blocks, which wait for one another, so only
    where the grid is one wave (row-groups x K-slices <= ``sms``), with at least 2 K-slices and one level
    (no ``fanin``)."""
    warps = warps or 16
    if warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"warps must be a power of two from 1 to 32, got {warps}")
    main = main or "shared"
    build = build or "fma"
    if build not in TABLE_BUILDS:
        raise ValueError(f"build must be one of {TABLE_BUILDS}, got {build!r}")
    if build in ("mma", "banked") and main not in ("shared", "global"):
        raise ValueError(f"the {build} build reads both codebooks from shared memory or from global memory (through L1): "
                         "main must be 'shared' or 'global'")
    if build == "banked":
        if B != 1:
            raise ValueError(f"the banked table (fp16, {BANKED_GS} groups a step) is a batch-1 kernel, got batch {B}")
        if G is None:  # 16 groups where they fit beside the codebooks, else 8 (and 8 with them in global memory)
            G = next((g for g in BANKED_GS if table_bytes(Nm, Nr, 1, g, 1, main, build) <= budget - 8192), BANKED_GS[-1])
        if G not in BANKED_GS:
            raise ValueError(f"the banked table takes G in {BANKED_GS} groups a step, got {G}")
    if build == "fma" and main not in TABLE_PLACEMENTS:
        raise ValueError(f"the table kernel's main codebook goes in one of {TABLE_PLACEMENTS}, got {main!r}")
    if G is None:
        gmax = 8 if build == "mma" else 2
        fits = [g for g in TABLE_STEPS if g <= gmax and table_bytes(Nm, Nr, B, g, 1, main, build) <= budget - 8192]
        G = max(fits) if fits else 1
    if G not in TABLE_STEPS and build != "banked":
        raise ValueError(f"G (groups a table step) must be one of {TABLE_STEPS}, got {G}")
    rbs = -(-n_out // ROW_BLOCK)
    if RB is None:
        need = -(-rbs // warps)
        RB = next(r for r in TABLE_RB if r >= min(need, TABLE_RB[-1]))
    if RB not in TABLE_RB:
        raise ValueError(f"RB (row-blocks a warp) must be one of {TABLE_RB}, got {RB}")
    static = _static_bytes(Nr, B, warps, norm)
    if static > STATIC_LIMIT:
        raise ValueError(f"batch {B} with {warps} warps needs {static} bytes of static shared memory (> {STATIC_LIMIT})")
    nsteps = nchunks * VECS_PER_CHUNK // G
    groups = -(-rbs // (warps * RB))
    if ksplit is None:
        # At most one wave: a table block fills an SM, and ceil() here gave 4096 x 28672 133 blocks on
        # 132 SMs, one block running alone after the rest (ncu: 1.01 waves).
        ksplit = max(1, min(nsteps, sms // groups))
    if ksplit < 1:
        raise ValueError(f"ksplit must be positive, got {ksplit}")
    sps = math.ceil(nsteps / min(ksplit, nsteps))
    ksplit = math.ceil(nsteps / sps)
    dyn = table_bytes(Nm, Nr, B, G, sps, main, build)
    if static + dyn > budget:
        raise ValueError(f"plan needs {static + dyn} bytes of shared memory (a {B} x {G} x {Nm + Nr} {'fp16' if build == 'banked' else 'fp32'} table and "
                         f"{sps * 8 * G} columns of x, batch {B}); the block may use {budget}: lower G or raise ksplit")
    fanin = fanin or 0
    if fanin < 0 or fanin == 1:
        raise ValueError(f"fanin (K-slices a level-one sum of the finish) must be 0 (one level) or at least 2, got {fanin}")
    spread = bool(spread)
    if spread:
        why = ("it needs at least 2 K-slices" if ksplit < 2 else "it is one level: no fanin" if fanin
               else f"its grid, {groups} row-groups x {ksplit} K-slices, is more than one wave on {sms} SMs "
                    "(its blocks wait for one another, so all must run at once)" if groups * ksplit > sms else "")
        if why:
            raise ValueError(f"the spread finish does not fit this plan: {why}")
    return ResidualPlan(warps, ksplit, sps, RB, main, dyn, static, kind="table", G=G, build=build, fanin=fanin, spread=spread)


def candidate_plans(n_out: int, nchunks: int, Nm: int, Nr: int, B: int, sms: int, norm: bool, budget: int) -> list[ResidualPlan]:
    """What the tuner times. Batches up to :data:`TABLE_MAX_BATCH`: the table kernel's heuristic plan
    with one, two and four waves of K-slices, its register-codebook variant at RB <= 2, its
    tensor-core build (v3) with one and two waves (and at RB = 7, and with the finish in two levels
    where a plan has more than 8 K-slices), each banked one-level plan with a K-split also with its finish
    spread (where its grid is one wave), and the
    gather kernel's heuristic plan (three kernels: each takes seconds to compile), and where that
    plan leaves SMs idle, gather blocks of 2 and 1 warps over every chunk, and the split kernel's
    heuristic plan. Gather kernel (larger
    batches): warps 4/8, RB 1/2, both main placements, a K-split ladder. Grids of at most 16 blocks an SM."""
    seen, out = set(), []
    rbs = -(-n_out // ROW_BLOCK)

    def plan_or_none(**kw) -> ResidualPlan | None:
        try:
            return plan_residual(n_out, nchunks, Nm, Nr, B, sms, norm, budget, **kw)
        except ValueError:
            return None

    def add(**kw):
        p = plan_or_none(**kw)
        if p is None:
            return
        gx, gy = p.grid(rbs)
        blocks = gx * gy
        k = (p.kind, p.warps, p.RB, p.main, p.ksplit, p.G, p.build, p.blocks, p.rc, p.lanes, p.fanin, p.spread)
        if k not in seen and blocks <= 16 * sms:
            seen.add(k)
            out.append(p)
            if p.build == "banked" and p.ksplit > 1 and not p.fanin and not p.spread:
                add(**p.overrides(), spread=True)  # its twin with the finish spread, where the grid is one wave

    def tensor_core_variants(h: ResidualPlan):
        # A tensor-core table's heuristic plan h with one and two waves of K-slices, at RB = 7 too, and with
        # the finish in two levels where a plan has more than 8 K-slices.
        for ks in (h.ksplit, 2 * h.ksplit):
            add(kind="table", RB=h.RB, G=h.G, main=h.main, warps=h.warps, ksplit=ks, build=h.build)
        for RB in (h.RB, 7) if h.RB == 8 else (h.RB,):
            p = plan_or_none(kind="table", RB=RB, G=h.G, main=h.main, warps=h.warps, build=h.build)
            if p is not None and RB != h.RB:
                add(**p.overrides())
            if p is not None and p.ksplit > 8:
                add(**p.overrides(), fanin=FINISH_FANIN)

    if B <= TABLE_MAX_BATCH:
        # Measured (H100): the shared-codebook table with 4096 rows a table wins only at the largest
        # layers; the register-codebook table at RB = 2 (no 64 KiB staging a block) and the gather
        # kernel win at smaller ones. So all three compete: three kernels, K-splits of 1-4 waves.
        # Each kernel's heuristic may not fit a small budget (99 KiB a block on sm_86/sm_89: the table
        # kernel's fp32 table at 8192 main entries, or at batch 2-4): those kernels are left out, not fatal.
        h = plan_or_none(kind="table")
        if h is not None:
            for ks in (h.ksplit, 2 * h.ksplit, 4 * h.ksplit):
                add(kind="table", RB=h.RB, G=h.G, main=h.main, warps=h.warps, ksplit=ks)
        if Nm <= 8 * 16 * 32:  # 8 entries a thread of 16 warps: the codebook fits in registers
            r = plan_or_none(kind="table", main="registers", RB=min(2, h.RB) if h is not None else None)
            if r is not None:
                for ks in (r.ksplit, 2 * r.ksplit):
                    add(kind="table", RB=r.RB, G=r.G, main="registers", warps=r.warps, ksplit=ks)
        m = plan_or_none(kind="table", build="mma")  # v3: the table built on the tensor cores, as many groups a step as fit
        if m is not None:
            tensor_core_variants(m)
            # (Not timed: two 8-warp blocks an SM with the codebooks read through L1, main="global".
            # Measured at 64be687 it ran 1.6-2.6x slower than this plan at every shape probed.)
        # v6, the banked table (codebooks in global memory where shared cannot hold them beside the tables:
        # 8192 main centroids, 8 groups a step). Left out at 8192 centroids in session 67 (1.6-4.9x slower than
        # the best other plan); timed again since the build's loop went from 94 SASS instructions for 4 tiles
        # to 33 (NOTES "Session 68").
        k = None
        if B == 1:
            k = plan_or_none(kind="table", build="banked") or plan_or_none(kind="table", build="banked", main="global")
        if k is not None:
            tensor_core_variants(k)
            gx, gy = k.grid(rbs)
            if 2 * gx * gy <= sms:
                # Few rows (1024 x 14336: 4 row-groups of 3584-4096 rows x 8 K-slices, 32 blocks on 132 SMs): smaller
                # row-groups fill the GPU, each block paying its step's table build over fewer rows.
                for RB in (4, 2, 1):
                    if RB < k.RB:
                        add(kind="table", build="banked", RB=RB, G=k.G, main=k.main, warps=k.warps)
        add(kind="gather")
        g = plan_or_none(kind="gather")
        if g is not None and -(-rbs // (g.warps * g.RB)) * g.ksplit < sms:
            # Small layers: the heuristic gather grid (4 warps, RB = 2, at most one K-slice a chunk)
            # leaves SMs idle (1024 x 1024: 16 blocks). Narrower blocks over every chunk fill more.
            for warps, RB in ((2, 1), (1, 1)):
                add(kind="gather", warps=warps, RB=RB, ksplit=nchunks)
        # The split kernel: its heuristic plan, half its warps (two chunks a warp), RB = 2 at both warp
        # counts, and K-splits of 1 and half the heuristic's where it splits K. Probe on the H100 (session 31,
        # data/_runs/residual-xgrp-probe-h100.json): no one of these was fastest everywhere; e.g.
        # 8192 x 14336 (8192 + 512) 56.8 us at RB = 2 and 8 warps against the heuristic's 61.1,
        # 1024 x 1024 4.8 us at K-split 1 against 6.5. A kernel to compile (~5 s) for each new warp count,
        # RB and rc. Each plan with as many copies of the residual codebook as fit (rc, up to 8: 4096 x 28672
        # 53 -> 44 us) and, where an SM's share of the vectors is under 16 per main entry (the gather planner's
        # staging rule), with 2 as well: there the block's staging is much of its time (2048 x 1024,
        # 4096 + 256: rc = 8 6.6 us, 2 5.7; data/_runs/residual-rc-probe-h100.json).
        small = n_out * nchunks * VECS_PER_CHUNK < 16 * Nm * sms
        for RB in (1, 2):
            s = plan_or_none(kind="split", RB=RB)
            if s is None:
                continue
            splits = [dict(), dict(warps=max(1, s.warps // 2))]
            if RB == 1 and s.ksplit > 1:
                splits += [dict(ksplit=1), dict(ksplit=s.ksplit // 2)]
            for kw in splits:
                add(kind="split", RB=RB, **kw)
                if small:
                    add(kind="split", RB=RB, rc=2, **kw)
        if 2 * rbs <= sms:
            # Few row-groups (1024 outputs: 32 of 32 rows on 132 SMs): lane splits of 2 and 4 give 2-4x the blocks,
            # each with a share of the gathers, and no K-split finish. Their heuristic warps and at least 4 (threads
            # to stage the codebooks), as many residual copies as fit and 2.
            for S in LANE_SPLITS[1:]:
                ls = plan_or_none(kind="split", lanes=S)
                for warps in sorted({ls.warps, max(4, ls.warps)}) if ls is not None else ():
                    for rc in (None, 2):
                        add(kind="split", lanes=S, warps=warps, rc=rc)
    else:
        for warps in (4, 8):
            for RB in ((1, 2) if B <= 8 else (1,)):
                for main in MAIN_PLACEMENTS:
                    for ks in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
                        if ks <= nchunks:
                            add(kind="gather", warps=warps, RB=RB, main=main, ksplit=ks)
    return out or [plan_residual(n_out, nchunks, Nm, Nr, B, sms, norm, budget)]


_TUNED = PlanCache("residual", ResidualPlan)


class ResidualGemv:
    """A residual-VQ weight prepared for the fused kernel on one device: ``y = gemv(x)``.

    ``plan``: overrides for :func:`plan_residual` (keys warps, RB, ksplit, main); otherwise the plan is
    tuned on a GPU (``tune=True``) or taken from the heuristic. Holds the words in the kernel's tiled
    layout only; :attr:`t` rebuilds the natural layout on demand.
    """

    max_batch = 16  # larger batches: QLinear's dequantize + cuBLAS (the correctness sweep checks up to 16)

    def __init__(self, t: ResidualTensor, device=None, plan: dict | None = None, tune: bool = True):
        self.device = kernel_device(device, "ResidualGemv")
        t.validate()
        t = t.to(self.device)
        self.n_in, self.n_out, self.Nm, self.Nr = t.in_features, t.out_features, t.Nm, t.Nr
        self.b = sum(t.bits)
        self.norm = t.has_norm
        self.fixed_plan = plan
        self.tune_on_gpu = tune and not SIM and tuning_enabled("residual")
        self.weight_bytes = t.nbytes
        self.nchunks = self.n_in // CHUNK
        self.rbs = -(-self.n_out // ROW_BLOCK)
        self._n_words = t.indices.shape[1]
        self._tiled_t = tile_indices(t.indices, self.n_out, self.b)
        if self._tiled_t.numel() >= 2**32:  # the kernels address the words with 32-bit unsigned offsets
            raise ValueError(f"{self.n_out} x {self.n_in} needs {self._tiled_t.numel()} index words; the kernels address "
                             "at most 2**32: split the layer")
        self._main_t, self._res_t = t.main.contiguous(), t.res.contiguous()
        self._scale_t, self._bias_t = t.scale, t.bias
        self._mainq_t = self._main_t.reshape(-1).view(torch.int32)
        self._resq_t = self._res_t.reshape(-1).view(torch.int32)
        if self.norm:
            self._sc_t, self._bi_t = t.scale.view(torch.int32), t.bias.view(torch.int32)
        else:
            self._sc_t = self._bi_t = torch.zeros(4, dtype=torch.int32, device=self.device)
        self._tiled = _as_kernel_array(self._tiled_t)
        self._skewed: dict = {}  # G -> the banked table's skewed words and their kernel view, made on first use (see words)
        self._cbexp = codebook_exponent(torch.cat([self._main_t, self._res_t]))
        self._fixed_args = tuple(_as_kernel_array(a) for a in (self._mainq_t, self._resq_t, self._sc_t, self._bi_t))
        self._plans: dict[int, list] = {}

    @property
    def t(self) -> ResidualTensor:
        """The weight in the natural layout (rebuilt from the tiled words: a copy)."""
        words = untile_indices(self._tiled_t, self.n_out, self._n_words, self.b)
        return ResidualTensor(words, self._main_t, self._res_t, self.n_in, self.n_out, self._scale_t, self._bias_t)

    def words(self, plan: ResidualPlan) -> torch.Tensor:
        """The tiled words ``plan``'s kernel reads: the banked table's are skewed (:func:`skew_indices`),
        made from the others on first use and kept beside them (the layer then holds its words twice)."""
        if plan.build != "banked":
            return self._tiled_t
        if plan.G not in self._skewed:
            natural = untile_indices(self._tiled_t, self.n_out, self._n_words, self.b)
            w = tile_indices(skew_indices(natural, self.Nm, self.Nr, plan.G), self.n_out, self.b)
            self._skewed[plan.G] = (w, _as_kernel_array(w))
        return self._skewed[plan.G][0]

    def _words_view(self, plan: ResidualPlan):
        if plan.build != "banked":
            return self._tiled
        self.words(plan)
        return self._skewed[plan.G][1]

    @property
    def bytes_read(self) -> int:
        """Bytes a batch-1 call must move at least: words, codebooks, norm, x and y."""
        return self.weight_bytes + 2 * (self.n_in + self.n_out)

    def check_input(self, x: torch.Tensor) -> torch.Tensor:
        return check_activation(x, self.n_in, self.device)

    def _plan_for(self, B: int, **over) -> ResidualPlan:
        return plan_residual(self.n_out, self.nchunks, self.Nm, self.Nr, B, sm_count(self.device), self.norm,
                             shared_budget(self.device), **over)

    def _launch_parts(self, B: int, plan: ResidualPlan, stamps: bool = False) -> list:
        # stamps (table plans: see timeline): the instrumented kernel, and room for its stamps after the counters
        if plan.kind == "table":
            kern = residual_table_kernel(self.Nm, self.Nr, B, plan.warps, plan.RB, plan.G, self.norm, plan.main == "shared",
                                         plan.build == "mma", stamps=stamps, fanin=plan.fanin, banked=plan.build == "banked",
                                         spread=plan.spread)
        else:
            kern = residual_kernel(self.Nm, self.Nr, B, plan.warps, plan.RB, plan.main == "shared", self.norm,
                                   split=plan.kind == "split", rc=plan.rc, lanes=plan.lanes)
        ngroups = plan.groups(self.rbs)
        slices, ncount = finish_sizes(plan.ksplit, ngroups, plan.fanin, plan.spread) if plan.kind == "table" else (plan.ksplit, ngroups)
        ws = torch.empty(slices, B, self.rbs * ROW_BLOCK, dtype=torch.float32, device=self.device)
        gx, gy = plan.grid(self.rbs)
        counters = torch.zeros(ncount + (STAMPS * gx * gy if stamps else 0), dtype=torch.int32, device=self.device)
        # [kernel, plan, torch owners, views, grid, specialized kernel (made at first bind)]
        return [kern, plan, (ws, counters), (_as_kernel_array(ws), _as_kernel_array(counters)), (gx, gy), None]

    def _prepare(self, B: int) -> list:
        if B not in self._plans:
            if self.fixed_plan is not None:
                plan = self._plan_for(B, **self.fixed_plan)
            elif self.tune_on_gpu:
                plan = self.tune(B)
            else:
                plan = self._plan_for(B)
            self._plans[B] = self._launch_parts(B, plan)
        return self._plans[B]

    def plan(self, B: int = 1) -> ResidualPlan:
        return self._prepare(B)[1]

    def _launcher(self, entry: list, xa, ya, tiled, out=None):
        kern, plan, _owners, (wsa, cnta), grid, _ = entry
        args = (xa, tiled, *self._fixed_args, ya, wsa, cnta, self.n_out, self.rbs, self.nchunks, plan.cps, self._cbexp)
        if entry[5] is None:
            entry[5] = with_shared_limit(kern, args, plan.shared_bytes)
        spec, block, smem, dev = entry[5], plan.warps * 32, plan.shared_bytes, self.device

        def launch():
            stream = 0 if SIM else cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
            spec[grid, block, stream, smem](*args)
            if SIM and out is not None:
                out.copy_(torch.from_numpy(ya).view(out.shape))

        return launch

    def tune(self, B: int = 1) -> ResidualPlan:
        """Time every candidate plan (CUDA-graph replays over copies of the words that exceed the L2;
        :func:`trapetum.bench.pick_fastest`) and keep the fastest; cached per GPU model and shape."""
        key = (torch.cuda.get_device_name(self.device), self.Nm, self.Nr, self.norm, B, self.n_in, self.n_out)
        if key in _TUNED:
            return _TUNED[key]
        from .bench import pick_fastest

        cands = candidate_plans(self.n_out, self.nchunks, self.Nm, self.Nr, B, sm_count(self.device), self.norm,
                                shared_budget(self.device))
        if len(cands) == 1:
            _TUNED[key] = cands[0]
            return cands[0]
        inputs = {}  # a word layout's copies past the L2 (the banked table's are skewed)

        def launchers(plan):
            lay = plan.G if plan.build == "banked" else 0
            if lay not in inputs:
                inputs[lay] = tuning_inputs(self.words(plan), self.weight_bytes, self.n_in, self.n_out, B, self.device)
            _, views, xa, ya = inputs[lay]
            entry = self._launch_parts(B, plan)
            return [self._launcher(entry, xa, ya, v) for v in views]

        def skip(plan, e):  # a candidate that cannot launch here is skipped, not fatal
            warnings.warn(f"residual plan {plan} skipped: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)

        best = pick_fastest(cands, launchers, self.device, on_error=skip)
        del inputs
        if best is None:
            raise RuntimeError(f"no residual plan launches for {self.n_in}x{self.n_out}, batch {B}")
        used = {p.G for p in [best] + [e[1] for e in self._plans.values()] if p.build == "banked"}
        self._skewed = {G: w for G, w in self._skewed.items() if G in used}  # the others were made for the timing only
        _TUNED[key] = best
        return best

    def bind(self, x: torch.Tensor, out: torch.Tensor, tiled=None):
        """A zero-argument launcher for fixed x and out buffers (views made here, so it can be
        captured in a CUDA graph; it launches on torch's stream current at call time).
        ``tiled``: another copy of the tiled words (a kernel-array view), for L2-rotating benchmarks."""
        x2 = self.check_input(x)
        B = x2.shape[0]
        check_output(out, B, self.n_out, x2.device)
        entry = self._prepare(B)
        return self._launcher(entry, _as_kernel_array(x2.view(torch.int32)), _as_kernel_array(out),
                              self._words_view(entry[1]) if tiled is None else tiled, out)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x2 = self.check_input(x)
        y = out if out is not None else torch.empty(x2.shape[0], self.n_out, dtype=torch.float16, device=x2.device)
        self.bind(x2, y)()
        return y.reshape(self.n_out) if x.dim() == 1 else y

    def timeline(self, x: torch.Tensor, plan: dict | None = None, launches: int = 3):
        """Where a table-kernel launch's time goes: the last of ``launches`` launches on x with every
        block's clock read at its start, after its prologue (codebooks and x staged), after its last
        table step and after its finish (see ``stamps`` of :func:`residual_table_kernel`).

        A DataFrame, a row a block: block_x (row-group), block_y (K-slice), sm, start, prologue,
        steps, finish (ns after the first block's start; in the simulator, a count of clock reads)
        and sums (2: the block summed its row-group's partials into y; 1: it summed a run of
        K-slices, the first level of the finish; 3: a spread finish's share of the rows; 0: none). ``plan``: overrides, as for
        the constructor (by default this layer's plan, which must be a table plan). A diagnostic:
        the clock reads and their stores make the launch a little slower than an uninstrumented one."""
        import numpy as np
        import pandas as pd

        x2 = self.check_input(x)
        B = x2.shape[0]
        p = self._plan_for(B, **plan) if plan is not None else self.plan(B)
        if p.kind != "table":
            raise ValueError(f"timeline times the table kernel; this layer's plan is a {p.kind} plan: pass plan=dict(kind='table', ...)")
        entry = self._launch_parts(B, p, stamps=True)
        gx, gy = entry[4]
        counters = entry[2][1]
        ncount = counters.numel() - STAMPS * gx * gy
        y = torch.empty(B, self.n_out, dtype=torch.float16, device=self.device)
        launch = self._launcher(entry, _as_kernel_array(x2.view(torch.int32)), _as_kernel_array(y), self._words_view(p), y)
        for _ in range(launches):
            launch()
        st = counters[ncount:].cpu().numpy().astype(np.int64).reshape(gy, gx, STAMPS) & 0xFFFFFFFF
        t0 = st[..., 1].min()
        rel = (st[..., 1:5] - t0) % 2**32  # the clock's low word may wrap within the launch
        by, bx = np.meshgrid(np.arange(gy), np.arange(gx), indexing="ij")
        return pd.DataFrame(dict(block_x=bx.ravel(), block_y=by.ravel(), sm=st[..., 0].ravel(), start=rel[..., 0].ravel(),
                                 prologue=rel[..., 1].ravel(), steps=rel[..., 2].ravel(), finish=rel[..., 3].ravel(),
                                 sums=st[..., 5].ravel()))

    def dequantize(self, dtype=torch.float16, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The (out, in) weight, built on the device with torch ops (from a transient natural copy);
        ``rows=(r0, r1)`` (r0 a multiple of 32): only that slab, for QLinear's large batches."""
        r0, r1 = check_rows(rows, self.n_out)
        words = untile_indices(self._tiled_t, self.n_out, self._n_words, self.b, rows=(r0, r1))
        return ResidualTensor(words, self._main_t, self._res_t, self.n_in, r1 - r0, self._scale_t, self._bias_t).dequantize(dtype)


def reference(x: torch.Tensor, t: ResidualTensor, rows: int = 4096) -> torch.Tensor:
    """float64 y = x @ W.T, computed on t's device in row blocks (no full float64 weight), returned on the CPU."""
    x64 = x.detach().to(t.indices.device, torch.float64).reshape(-1, t.in_features)
    out = torch.empty(x64.shape[0], t.out_features, dtype=torch.float64, device=t.indices.device)
    for r0 in range(0, t.out_features, rows):
        part = ResidualTensor(t.indices[r0:r0 + rows], t.main, t.res, t.in_features, min(rows, t.out_features - r0), t.scale, t.bias)
        out[:, r0:r0 + rows] = x64 @ part.dequantize(torch.float64).T
    return out.cpu()


# -- GPU checks and timing (the notebook's entry points) --------------------------------------
def check_residual(n_in: int, n_out: int, Nm: int, Nr: int, batch: int, seed: int, device="cuda", plan: dict | None = None,
                   with_norm: bool = False, tune: bool = True) -> float:
    """Max relative error against float64 on fresh random inputs, output poisoned first; raises if any output is unwritten."""
    t = random_residual_tensor(n_out, n_in, Nm, Nr, seed=seed, device=device, with_norm=with_norm)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    from .bench import poisoned_check

    x = torch.randn(batch, n_in, generator=g).half().to(device)
    return poisoned_check(ResidualGemv(t, device=device, plan=plan, tune=tune), x, lambda x: reference(x, t),
                          f"residual {Nm}/{Nr} batch={batch} {n_in}x{n_out} plan={plan}")


# Forced plans the sweep adds: every value of every knob at least once, few kernel variants to compile.
FORCED_PLANS = (dict(main="shared", ksplit=1, RB=2, warps=4), dict(main="global", ksplit=3, RB=1, warps=8),
                dict(main="shared", ksplit=3, RB=1, warps=8), dict(main="global", ksplit=1, RB=2, warps=4),
                # the table kernel: every G but 8, both codebook placements, RB 1/2/4, uneven K-slices of steps
                dict(kind="table", G=1, RB=1, warps=8, ksplit=7, main="shared"),
                dict(kind="table", G=2, RB=4, warps=16, ksplit=3, main="shared"),
                dict(kind="table", G=4, RB=2, warps=32, ksplit=2, main="registers"),
                # v3, tensor-core build: 8 groups a step (4096 centroids only), and G = 1 with fewer
                # warps than M-tiles need (several tiles a warp, uneven)
                dict(kind="table", build="mma", G=8, RB=8, warps=16, ksplit=3, main="shared"),
                dict(kind="table", build="mma", G=1, RB=2, warps=4, ksplit=5, main="global"),
                # v6, the banked fp16 table (4096 centroids only): RB = 7, uneven K-slices; codebooks from global
                # memory, a finish in two levels
                dict(kind="table", build="banked", RB=7, warps=16, ksplit=3, main="shared"),
                dict(kind="table", build="banked", RB=2, warps=8, ksplit=6, main="global", fanin=4),
                dict(kind="table", build="banked", G=8, RB=4, warps=16, ksplit=3, main="global"),  # (8192 centroids too)
                # the finish spread over a row-group's blocks: up to 12 K-slices (two threads a row quad past 8), the last
                # block's share short (one wave only: the sweep skips it where the grid is more than one wave)
                dict(kind="table", build="banked", RB=2, warps=8, ksplit=12, main="global", spread=True),
                # the split kernel's lane splits: groups of 16 rows over two warps; of 8 rows, one warp, walking blocks
                dict(kind="split", lanes=2, warps=2, rc=2), dict(kind="split", lanes=4, warps=1, blocks=5))


def _fits(plan: dict, n_in: int, n_out: int, Nm: int, Nr: int, B: int, norm: bool, sms: int = 132,
          budget: int = OPTIN_SIM) -> bool:
    """Whether a forced plan can be made for this layer on a GPU of ``sms`` SMs and ``budget`` bytes of
    shared memory a block (by default an H100's): G = 8 tables do not fit beside 8192 centroids, and a
    spread finish needs a one-wave grid; that is the planner's refusal, not a kernel failure."""
    try:
        plan_residual(n_out, n_in // CHUNK, Nm, Nr, B, sms, norm, budget, **plan)
        return True
    except ValueError:
        return False


def correctness_sweep(shapes, configs=((4096, 256), (8192, 512)), batches=(1, 2, 3, 8, 16), seed=0, norms=(False, True),
                      progress=True, device="cuda", tune: bool = False, forced: bool = True) -> list[dict]:
    """The kernel (heuristic plan, or tuned with ``tune=True``: slower, it compiles every candidate) on
    every shape x config x batch x norm, plus :data:`FORCED_PLANS` on the first shape (gather plans
    at batch 3, table plans at batch 1: a table of 3 batch rows does not fit beside 8192 centroids);
    raises AssertionError listing every failure (tolerance 2e-3 of max |ref|)."""
    from tqdm.auto import tqdm

    jobs = [(s, c, b, nm, None) for s in shapes for c in configs for b in batches for nm in norms]
    if forced:  # every plan knob, each one a kernel to compile
        forced_jobs = [(shapes[0], c, 1 if p.get("kind") == "table" else 3, bool(k % 2) if len(norms) > 1 else norms[0], p)
                       for c in configs for k, p in enumerate(FORCED_PLANS)]
        dev = torch.device(device)
        sms, budget = 132 if SIM else sm_count(dev), shared_budget(dev)  # (the simulator plans as an H100)
        jobs += [(s, c, b, nm, p) for s, c, b, nm, p in forced_jobs if _fits(p, *s, *c, b, nm, sms=sms, budget=budget)]
    recs, failures = [], []
    for i, ((n_in, n_out), (Nm, Nr), b, nm, plan) in enumerate(tqdm(jobs, desc="residual correctness", disable=not progress)):
        try:
            err = check_residual(n_in, n_out, Nm, Nr, b, seed=seed + i, device=device, plan=plan, with_norm=nm, tune=tune)
            ok = err <= TOLERANCE
        except Exception as e:  # noqa: BLE001 - a driver error names its plan and the sweep goes on
            err, ok = float("nan"), False
            failures.append(str(e) if isinstance(e, AssertionError) else f"{type(e).__name__} at plan={plan} "
                            f"batch={b} {n_in}x{n_out}: {e}")
        recs.append({"kernel": "residual", "main_centroids": Nm, "residual_centroids": Nr, "norm": nm, "batch": b,
                     "in_features": n_in, "out_features": n_out, "max_rel_err": err, "passed": ok,
                     "plan": str(plan) if plan else ("tuned" if tune else "heuristic")})
        if not ok and err == err:
            failures.append(f"residual {Nm}/{Nr} norm={nm} batch={b} {n_in}x{n_out} plan={plan}: max rel err {err:.3g} > {TOLERANCE}")
    if failures:
        raise AssertionError("residual correctness sweep failed:\n" + "\n".join(failures))
    return recs


def time_residual(n_in: int, n_out: int, Nm: int, Nr: int, batch: int, fp16_ms: float, seed: int = 0, with_norm: bool = False,
                  plan: dict | None = None) -> dict:
    """CUDA-graph time of the tuned kernel (or of ``plan``'s overrides) over rotated copies of the
    words (past L2), as bench.time_lut; the same plan then checked on fresh inputs."""
    from .bench import copies_for, gemv_record, time_graph

    t = random_residual_tensor(n_out, n_in, Nm, Nr, seed=seed, device="cuda", with_norm=with_norm)
    g = ResidualGemv(t, plan=plan)
    del t
    x = torch.randn(batch, n_in, device="cuda", dtype=torch.float16)
    y = torch.empty(batch, n_out, device="cuda", dtype=torch.float16)
    p = g.plan(batch)
    w = g.words(p)
    copies = [w] + [w.clone() for _ in range(copies_for(g.weight_bytes) - 1)]
    launchers = [g.bind(x, y, tiled=_as_kernel_array(c)) for c in copies]
    ms = time_graph(launchers)
    del launchers, copies, g
    torch.cuda.empty_cache()
    err = check_residual(n_in, n_out, Nm, Nr, batch, seed=seed + 7, with_norm=with_norm, plan=p.overrides())
    nbytes = index_bytes(n_in, n_out, Nm, Nr) + (Nm + Nr) * 16 + (4 * n_in if with_norm else 0) + 2 * batch * (n_in + n_out)
    return gemv_record("residual", None, batch, n_in, n_out, ms, fp16_ms, nbytes, err,
                       scheme=scheme_name(Nm, Nr), main_centroids=Nm, residual_centroids=Nr, vector_len=VECTOR_LEN,
                       bits_per_weight=(nbytes - 2 * batch * (n_in + n_out)) * 8 / (n_in * n_out), norm=with_norm,
                       ksplit=p.ksplit, warps=p.warps, rb=p.RB, main_placement=p.main, variant=p.kind, G=p.G,
                       build=p.build or None, rc=p.rc if p.kind == "split" else None,
                       lanes=p.lanes if p.kind == "split" else None, fanin=p.fanin if p.kind == "table" else None,
                       spread=p.spread if p.kind == "table" else None)
