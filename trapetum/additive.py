"""Additive (AQLM-style) vector codebooks: the format, the quantizer, the AQLM loader and a fused GEMV.

W[o, 8g:8g+8] = scale[o] * sum_m codebooks[m, codes[o, g, m]]

M codebooks (M = 2: 2 bits a weight, M = 4: 4 bits) of K = 256 entries of dimension D = 8, shared
by every group of 8 consecutive input weights of the layer, and one fp16 scale per output channel.
This is the public AQLM "Mx8" layout (in_group_size 8, out_group_size 1) with the codebooks'
singleton out-group axis dropped; :func:`from_aqlm` maps a checkpoint's tensors onto it one to one.

On disk a layer is a safetensors file (``codes``, ``codebooks``, ``scales`` and optionally
``bias``) with a JSON header under the metadata key ``trapetum`` (format version, kind, shapes, M,
K, D and a SHA-256 per tensor); corrupt, truncated and tampered files raise
:class:`~trapetum.codebook.CodebookFormatError`.

The kernel (:class:`AdditiveGemv`) builds, per thread block, a lookup table
LUT[b][g][m][k] = dot(codebooks[m, k], x[b, 8g:8g+8]) in shared memory (fp32, or fp16 scaled by a
power of two so no entry overflows) for its K-slice of groups, then each lane streams one row's
codes (pre-tiled so a warp's 16-byte-a-lane loads are contiguous, as :func:`trapetum.codebook.tile`
does for the scalar format) and adds M lookups a group. Rows of different warps share the table; K-slices of different blocks meet in an fp32
workspace that the last block to finish reduces (an atomic counter it resets, so it replays in a
CUDA graph). At M = 2 and batch 1 two more kernels read their own code layout, with lanes over groups
so every lookup is conflict-free: :func:`stream_kernel` (a block's rows over a K-slice, its chunks'
tables built in turn) and :func:`chunk_kernel` (one chunk's table a block, many rows streamed through
it); the tuner picks among all three.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import warnings

import torch
from numba import cuda, float32, int32, int64, uint16, uint32

from .codebook import CHUNK_BYTES, ROW_BLOCK, CodebookFormatError, _sha, check_rows, read_layer_file, untile
from .gemv import (
    FP16_HEADROOM,
    INLINE,
    ClusterBounds,
    MAX_FUSED_BATCH,
    OPTIN_SIM,
    PORTABLE_CLUSTER,
    SIM,
    _as_kernel_array,
    apply_post,
    apply_pre,
    async_wait_all,
    bits_float,
    cluster_sync,
    clusters_available,
    codebook_exponent,
    check_activation,
    check_fused,
    check_ops,
    check_output,
    copy16_async,
    float2_to_half2,
    float_bits,
    fp16_table_scale,
    fused_operands,
    fused_tuning_operands,
    half2_abs_bits,
    half2_to_float2,
    half_sum4,
    inv_rms,
    kernel_device,
    last_to_finish,
    load_cluster_f32,
    load16,
    load16_stream,
    load_byte_offset,
    load_cg,
    load_half_byte_offset,
    max_shared_bytes,
    mma_m16n8k8,
    mma_table_tile,
    launch_hooks,
    prmt,
    programmatic,
    rms_sums,
    rms_word,
    rows_summer,
    silu_word,
    sm_count,
    sum_splits,
    tuning_enabled,
    tuning_inputs,
    warp_max_u32,
    warp_sum_f32,
    warp_xor_f32,
    with_shared_limit,
)
from .bench import TOLERANCE, poisoned_check  # TOLERANCE: max |y - ref| / max |ref| a kernel may be off by
from .kmeans import check_finite
from .tuning import PlanCache

FORMAT_VERSION = 1
KIND = "additive-codebook"
K = 256  # entries a codebook (one byte a code)
D = 8  # weights a group (the codebooks' vector dimension)
SUPPORTED_M = (1, 2, 4)  # codebooks; 16 / M groups fill one 16-byte chunk of a row's codes
SCHEMES = {1: "1-bit additive (M=1)", 2: "2-bit additive (M=2)", 4: "4-bit additive (M=4)"}


def check_M(M: int) -> None:
    if M not in SUPPORTED_M:
        raise ValueError(f"M (codebooks) must be one of {SUPPORTED_M}, got {M!r}")


def groups_per_chunk(M: int) -> int:
    return CHUNK_BYTES // M


def check_in_features(in_features: int, M: int) -> None:
    """in_features must be whole groups of 8 and fill whole 16-byte chunks of codes (16 / M groups)."""
    if in_features <= 0 or in_features % D:
        raise ValueError(f"in_features={in_features} is not divisible by {D}: additive codebooks quantize groups of {D} weights")
    cols = D * groups_per_chunk(M)
    if in_features % cols:
        raise ValueError(
            f"in_features={in_features} is not divisible by {cols}: with M={M} a 16-byte chunk of a row's "
            f"codes holds {groups_per_chunk(M)} groups of {D}, and the kernels read whole chunks"
        )


# -- the format ------------------------------------------------------------------------------
@dataclass
class AdditiveTensor:
    """A quantized weight: codes (out, in/8, M) uint8, codebooks (M, 256, 8) fp16, scales (out,) fp16.

    ``bias`` (out,) fp16 is optional and not part of the weight (dequantize leaves it out); the
    GEMV adds it. Integer codes of another dtype are range-checked and stored as uint8.
    """

    codes: torch.Tensor
    codebooks: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None = field(default=None)

    def __post_init__(self):
        c = self.codes
        if isinstance(c, torch.Tensor) and c.dtype != torch.uint8 and not c.dtype.is_floating_point and c.dtype != torch.bool:
            if c.numel() and (int(c.min()) < 0 or int(c.max()) >= K):
                raise CodebookFormatError(f"codes out of range: found [{int(c.min())}, {int(c.max())}], K={K} allows [0, {K - 1}]")
            self.codes = c.to(torch.uint8)
        self.validate()

    @property
    def M(self) -> int:
        return int(self.codebooks.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[1]) * D

    @property
    def nbytes(self) -> int:
        """Codes, codebooks and scales (the bias is not part of the weight)."""
        return self.codes.numel() + 2 * (self.codebooks.numel() + self.scales.numel())

    @property
    def bits_per_weight(self) -> float:
        """Code bits (8 M / 8 = M) plus the codebooks' and scales' share."""
        return self.nbytes * 8 / (self.out_features * self.in_features)

    def validate(self) -> None:
        c, cb, s = self.codes, self.codebooks, self.scales
        for name, t in (("codes", c), ("codebooks", cb), ("scales", s)):
            if not isinstance(t, torch.Tensor):
                raise CodebookFormatError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if c.dtype.is_floating_point or c.dtype == torch.bool:
            raise CodebookFormatError(f"codes must be an integer tensor (uint8), got {c.dtype}")
        if c.dtype != torch.uint8:
            raise CodebookFormatError(f"codes must be uint8, got {c.dtype}")
        if cb.dtype != torch.float16:
            raise CodebookFormatError(f"codebooks must be float16, got {cb.dtype}")
        if s.dtype != torch.float16:
            raise CodebookFormatError(f"scales must be float16, got {s.dtype}")
        if cb.dim() != 3 or cb.shape[1:] != (K, D):
            raise CodebookFormatError(f"codebooks shape {tuple(cb.shape)} is not (M, {K}, {D})")
        M = cb.shape[0]
        if M not in SUPPORTED_M:
            raise CodebookFormatError(f"{M} codebooks: M must be one of {SUPPORTED_M}")
        if c.dim() != 3 or c.shape[2] != M:
            raise CodebookFormatError(f"codes shape {tuple(c.shape)} is not (out, in/{D}, M={M}) for codebooks {tuple(cb.shape)}")
        try:
            check_in_features(c.shape[1] * D, M)
        except ValueError as e:
            raise CodebookFormatError(str(e)) from e
        if tuple(s.shape) != (c.shape[0],):
            raise CodebookFormatError(f"scales shape {tuple(s.shape)} != ({c.shape[0]},) (one per output channel)")
        if self.bias is not None:
            b = self.bias
            if not isinstance(b, torch.Tensor) or b.dtype != torch.float16 or tuple(b.shape) != (c.shape[0],):
                raise CodebookFormatError(f"bias must be a float16 tensor of shape ({c.shape[0]},)")
            if b.device != c.device or not torch.isfinite(b).all():
                raise CodebookFormatError("bias must be finite and on the codes' device")
        if cb.device != c.device or s.device != c.device:
            raise CodebookFormatError(f"codes on {c.device}, codebooks on {cb.device}, scales on {s.device}")
        if not torch.isfinite(cb).all():
            raise CodebookFormatError("codebooks have NaN/Inf entries")
        if not torch.isfinite(s).all():
            raise CodebookFormatError("scales have NaN/Inf entries")

    def to(self, device) -> "AdditiveTensor":
        return AdditiveTensor(self.codes.to(device), self.codebooks.to(device), self.scales.to(device),
                              None if self.bias is None else self.bias.to(device))

    def dequantize(self, dtype=torch.float16) -> torch.Tensor:
        """The (out, in) weight (computed in fp32, or float64 when asked for)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        return _decode(self.codes, self.codebooks.to(work), self.scales.to(work)).to(dtype)

    # -- serialization -------------------------------------------------------------------
    def _tensors(self) -> dict:
        t = {"codes": self.codes, "codebooks": self.codebooks, "scales": self.scales}
        if self.bias is not None:
            t["bias"] = self.bias
        return {k: v.detach().cpu().contiguous() for k, v in t.items()}

    def header(self) -> dict:
        tensors = self._tensors()
        return {
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            "M": self.M,
            "K": K,
            "D": D,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "shapes": {k: list(v.shape) for k, v in tensors.items()},
            "sha256": {k: _sha(v) for k, v in tensors.items()},
        }

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        save_file(self._tensors(), str(path), metadata={"trapetum": json.dumps(self.header())})
        return path

    @classmethod
    def load(cls, path: str | Path, device="cpu") -> "AdditiveTensor":
        h, tensors = read_layer_file(path, KIND, FORMAT_VERSION, "additive codebook")
        path = Path(path)
        if (h.get("K"), h.get("D")) != (K, D) or h.get("M") not in SUPPORTED_M:
            raise CodebookFormatError(f"{path}: header M={h.get('M')!r}, K={h.get('K')!r}, D={h.get('D')!r}; "
                                      f"this trapetum reads M in {SUPPORTED_M}, K={K}, D={D}")
        names = set(tensors)
        if not {"codes", "codebooks", "scales"} <= names <= {"codes", "codebooks", "scales", "bias"}:
            raise CodebookFormatError(f"{path}: expected tensors codes, codebooks, scales (and optionally bias), found {sorted(names)}")
        shapes, shas = h.get("shapes") or {}, h.get("sha256") or {}
        if set(shapes) != names:
            raise CodebookFormatError(f"{path}: the header lists tensors {sorted(shapes)}, the file holds {sorted(names)}")
        for name, t in tensors.items():
            if list(t.shape) != shapes.get(name):
                raise CodebookFormatError(f"{path}: {name} shape {list(t.shape)} != header {shapes.get(name)}")
            if _sha(t) != shas.get(name):
                raise CodebookFormatError(f"{path}: {name} bytes do not match the header's SHA-256 (file tampered or corrupt)")
        try:
            t = cls(tensors["codes"], tensors["codebooks"], tensors["scales"], tensors.get("bias"))
        except (ValueError, TypeError) as e:
            raise CodebookFormatError(f"{path}: {e}") from e
        if (t.M, t.in_features, t.out_features) != (h.get("M"), h.get("in_features"), h.get("out_features")):
            raise CodebookFormatError(f"{path}: tensors are M={t.M}, {t.out_features} x {t.in_features}; the header says "
                                      f"M={h.get('M')}, {h.get('out_features')} x {h.get('in_features')}")
        return t.to(device)


def _decode(codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(out, in) weight from codes (out, G, M), float codebooks (M, K, D) and scales (out,)."""
    n_out, G, M = codes.shape
    flat = codebooks.reshape(M * K, D)
    idx = codes.long() + torch.arange(M, device=codes.device) * K
    vecs = flat[idx].sum(2)  # (out, G, D)
    return (vecs * scales.reshape(n_out, 1, 1)).reshape(n_out, G * D)


def random_additive_tensor(out_features: int, in_features: int, M: int, seed: int = 0, device="cpu",
                           generator: torch.Generator | None = None) -> AdditiveTensor:
    """Random codes, normal codebooks and scales near 1, made on ``device`` (what benchmarks use)."""
    check_M(M)
    check_in_features(in_features, M)
    g = generator if generator is not None else torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, K, (out_features, in_features // D, M), dtype=torch.uint8, device=device, generator=g)
    cb = torch.randn(M, K, D, device=device, generator=g) * (0.02 / math.sqrt(M))
    scales = 1 + 0.1 * torch.rand(out_features, device=device, generator=g)
    return AdditiveTensor(codes, cb.half(), scales.half())


# -- the AQLM checkpoint layout --------------------------------------------------------------
class AqlmFormatError(CodebookFormatError):
    """An AQLM checkpoint this loader cannot map onto AdditiveTensor (unsupported variant or bad tensors)."""


def from_aqlm(state: dict, prefix: str = "") -> AdditiveTensor:
    """One AQLM ``QuantizedLinear`` (Mx8, in_group_size 8, out_group_size 1) from a state dict.

    ``{prefix}codes`` int8 (out, in/8, M): AQLM stores code c in [0, 256) as the int8 of the same
    bits (c - 256 for c >= 128; aqlm.utils.unpack_int_data reads it back as c % 256), which is
    exactly a uint8 view. ``{prefix}codebooks`` fp16 (M, 256, 1, 8), ``{prefix}scales`` fp16
    (out, 1, 1, 1) and the optional ``{prefix}bias`` (out,) map one to one.
    """
    try:
        codes, cb, scales = (state[prefix + k] for k in ("codes", "codebooks", "scales"))
    except KeyError as e:
        raise AqlmFormatError(f"no AQLM layer at prefix {prefix!r}: missing {e.args[0]!r}") from e
    bias = state.get(prefix + "bias")
    if cb.dim() != 4:
        raise AqlmFormatError(f"{prefix}codebooks shape {tuple(cb.shape)} is not (M, codebook_size, out_group_size, in_group_size)")
    M, size, og, ig = cb.shape
    if size != K:
        raise AqlmFormatError(f"{prefix}: codebook size {size} (nbits_per_codebook={int(size).bit_length() - 1}); only 8-bit codebooks (Mx8) are supported")
    if og != 1:
        raise AqlmFormatError(f"{prefix}: out_group_size={og}; only out_group_size=1 is supported")
    if ig != D:
        raise AqlmFormatError(f"{prefix}: in_group_size={ig}; only in_group_size={D} is supported")
    if M not in SUPPORTED_M:
        raise AqlmFormatError(f"{prefix}: {M} codebooks; supported: {SUPPORTED_M}")
    if codes.dtype not in (torch.int8, torch.uint8):
        raise AqlmFormatError(f"{prefix}codes dtype {codes.dtype}: Mx8 checkpoints store int8 codes")
    if codes.dim() != 3 or codes.shape[2] != M:
        raise AqlmFormatError(f"{prefix}codes shape {tuple(codes.shape)} is not (out, in/8, {M})")
    if tuple(scales.shape) != (codes.shape[0], 1, 1, 1):
        raise AqlmFormatError(f"{prefix}scales shape {tuple(scales.shape)} is not ({codes.shape[0]}, 1, 1, 1)")
    try:
        return AdditiveTensor(
            codes.contiguous().view(torch.uint8),
            cb.reshape(M, K, D).to(torch.float16).contiguous(),
            scales.reshape(-1).to(torch.float16).contiguous(),
            None if bias is None else bias.to(torch.float16).contiguous(),
        )
    except CodebookFormatError as e:
        raise AqlmFormatError(f"{prefix}: {e}") from e


def to_aqlm(t: AdditiveTensor) -> dict:
    """The inverse of :func:`from_aqlm`: AQLM's Mx8 tensors (codes int8, codebooks (M, 256, 1, 8),
    scales (out, 1, 1, 1), bias if any), on t's device; what the aqlm package's kernels take."""
    d = {"codes": t.codes.contiguous().view(torch.int8),
         "codebooks": t.codebooks.reshape(t.M, K, 1, D).contiguous(),
         "scales": t.scales.reshape(-1, 1, 1, 1).contiguous()}
    if t.bias is not None:
        d["bias"] = t.bias
    return d


def check_aqlm_config(config: dict) -> dict:
    """The quantization_config of an AQLM checkpoint's config.json, checked for what we read."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        raise AqlmFormatError("config.json has no quantization_config: not a quantized checkpoint")
    if q.get("quant_method") != "aqlm":
        raise AqlmFormatError(f"quant_method {q.get('quant_method')!r} is not 'aqlm'")
    want = {"in_group_size": D, "out_group_size": 1, "nbits_per_codebook": 8}
    for k, v in want.items():
        if q.get(k) != v:
            raise AqlmFormatError(f"unsupported AQLM variant: {k}={q.get(k)!r} (this loader reads "
                                  f"{q.get('num_codebooks')}x{q.get('nbits_per_codebook')} with {k}={v}; "
                                  "1x16 and out_group_size > 1 have no kernel here)")
    if q.get("num_codebooks") not in SUPPORTED_M:
        raise AqlmFormatError(f"unsupported AQLM variant: num_codebooks={q.get('num_codebooks')!r}, supported {SUPPORTED_M}")
    return q


def load_aqlm_checkpoint(folder: str | Path, device="cpu") -> dict[str, AdditiveTensor]:
    """{module name: AdditiveTensor} for every quantized linear of a Hugging Face AQLM checkpoint.

    Reads config.json (quantization_config) and model.safetensors, or the shards a
    model.safetensors.index.json names. A layer's bias, when present, rides on its tensor.
    """
    from safetensors.torch import safe_open

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    q = check_aqlm_config(json.loads(cfg_path.read_text()))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    state = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for k in f.keys():
                if k.rsplit(".", 1)[-1] in ("codes", "codebooks", "scales", "bias"):
                    state[k] = f.get_tensor(k)
    out = {}
    for k in sorted(state):
        if k.endswith(".codes"):
            prefix = k[: -len("codes")]
            t = from_aqlm(state, prefix)
            if t.M != q["num_codebooks"]:
                raise AqlmFormatError(f"{prefix}: {t.M} codebooks, config says num_codebooks={q['num_codebooks']}")
            out[prefix[:-1]] = t.to(device)
    if not out:
        raise AqlmFormatError(f"{folder}: no AQLM layers (no '*.codes' tensors) in {files}")
    return out


# -- the quantizer ---------------------------------------------------------------------------
@dataclass
class AdditiveReport:
    """What quantizing one matrix cost and how close it came."""

    M: int
    iters_run: int
    objective: str  # "mse" or "calibration" (||(W - W_hat) X^T||^2)
    rel_err_curve: list  # relative objective after init, then after each iteration (fp32 parameters)
    rel_err: float  # relative objective of the stored fp16 tensor
    rel_mse: float  # plain ||W - W_hat||^2 / ||W||^2 of the stored tensor
    max_abs_err: float
    seconds: float


def _kmeans(v: torch.Tensor, k: int, iters: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain Lloyd k-means of rows of v (N, D), seeded start from k distinct samples; returns (centroids, labels)."""
    N = v.shape[0]
    pick = torch.randperm(N, generator=gen)[:k].to(v.device)
    c = v[pick].clone()
    if c.shape[0] < k:  # fewer vectors than entries: repeat them (the codebook is still valid)
        c = c.repeat(-(-k // max(c.shape[0], 1)), 1)[:k]
    for _ in range(iters):
        lab = _nearest(v, c)
        sums = torch.zeros_like(c).index_add_(0, lab, v)
        cnt = torch.zeros(k, device=v.device, dtype=v.dtype).index_add_(0, lab, torch.ones_like(lab, dtype=v.dtype))
        empty = cnt == 0
        c = torch.where(empty[:, None], c, sums / cnt.clamp_min(1)[:, None])
        if empty.any():  # restart empty clusters on seeded random members
            c[empty] = v[torch.randint(0, N, (int(empty.sum()),), generator=gen).to(v.device)]
    return c, _nearest(v, c)


def _nearest(v: torch.Tensor, c: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
    cn = (c * c).sum(1)
    return torch.cat([(cn - 2 * v[i:i + chunk] @ c.T).argmin(1) for i in range(0, v.shape[0], chunk)])


def _beam_codes(b: torch.Tensor, s: torch.Tensor, Hg: torch.Tensor, cb: torch.Tensor, cur: torch.Tensor, beam: int) -> torch.Tensor:
    """Best codes (N, M) for N groups minimizing s^2 c^T Hg c - 2 s c.b, c = sum_m cb[m, code_m].

    Beam search: start from the current codes; for each codebook in turn, every beam entry tries
    all K codes of that codebook, and the best ``beam`` (partial code sets) survive. The current
    codes are always among the candidates, so the loss never increases.
    """
    N, M = cur.shape
    CH = cb @ Hg  # (M, K, D)
    q = (CH * cb).sum(-1)  # (M, K): c^T H c
    codes = cur[:, None, :].clone()  # (N, 1, M)
    s2 = (s * s)[:, None, None]
    for m in range(M):
        Bm = codes.shape[1]
        vec = cb[torch.arange(M, device=cb.device), codes.long()].sum(2)  # (N, Bm, D) current sums
        p = vec - cb[m][codes[..., m].long()]  # partial sum without codebook m
        pH = p @ Hg
        # loss(k) = s^2 [p H p + 2 CH_k . p + q_k] - 2 s [p.b + C_k.b]
        base = s2[..., 0] * (pH * p).sum(-1) - 2 * s[:, None] * (p * b[:, None, :]).sum(-1)  # (N, Bm)
        lk = s2 * (2 * p @ CH[m].T + q[m]) - 2 * (s[:, None] * (b @ cb[m].T))[:, None, :]  # (N, Bm, K)
        loss = (base[..., None] + lk).reshape(N, Bm * K)
        keep = min(beam, Bm * K)
        top = loss.topk(keep, dim=1, largest=False).indices
        src, k = top // K, top % K
        codes = codes.gather(1, src[..., None].expand(N, keep, M)).clone()
        codes[..., m] = k.to(codes.dtype)
    vec = cb[torch.arange(M, device=cb.device), codes.long()].sum(2)
    loss = (s2[..., 0] * ((vec @ Hg) * vec).sum(-1) - 2 * s[:, None] * (vec * b[:, None, :]).sum(-1))
    return codes[torch.arange(N, device=cb.device), loss.argmin(1)]


def recode(codes: torch.Tensor, target: torch.Tensor, groups: torch.Tensor | None = None, *, codebooks: torch.Tensor,
           scales: torch.Tensor, metric: torch.Tensor | None = None, beam: int = 4, chunk: int = 2**14) -> torch.Tensor:
    """New codes (out, G, M) for a target weight (out, in), codebooks and scales fixed: each group's
    codes by beam search for the least error to the target's 8 weights, squared, or in the metric
    of its 8 x 8 block of ``metric`` (in, in), e.g. the layer input's second moment E[x x^T].

    This is PV-tuning's discrete step (Malinovskii et al., 2024): fine-tuning proposes a better
    dense weight and the codes follow it. Only the (row, group) pairs where ``groups`` (bool,
    (out, G)) is True may change, so one step updates a chosen fraction of the codes. A group's
    current codes stay among the beam's candidates, so no group's error to the target grows."""
    n_out, G, M = codes.shape
    if tuple(target.shape) != (n_out, G * D):
        raise ValueError(f"target must be ({n_out}, {G * D}) for codes {tuple(codes.shape)}, got {tuple(target.shape)}")
    if groups is not None and tuple(groups.shape) != (n_out, G):
        raise ValueError(f"groups must be ({n_out}, {G}), got {tuple(groups.shape)}")
    if metric is not None and tuple(metric.shape) != (G * D, G * D):
        raise ValueError(f"metric must be ({G * D}, {G * D}), got {tuple(metric.shape)}")
    cb, s = codebooks.detach().float(), scales.detach().float()
    t = target.detach().float().reshape(n_out, G, D)
    out = codes.clone()
    mask = torch.ones(n_out, G, dtype=torch.bool, device=codes.device) if groups is None else groups

    def search(rows, cols, Hg):
        for i in range(0, rows.numel(), chunk):
            r, c = rows[i:i + chunk], cols[i:i + chunk]
            out[r, c] = _beam_codes(t[r, c] @ Hg, s[r], Hg, cb, codes[r, c], beam).to(out.dtype)

    if metric is None:  # one metric for every group: search every chosen (row, group) pair at once
        search(*mask.nonzero(as_tuple=True), torch.eye(D, device=cb.device))
    else:  # a column group's metric block is shared by its rows: search them together
        for g in range(G):
            rows = mask[:, g].nonzero().squeeze(1)
            search(rows, torch.full_like(rows, g), metric[g * D:(g + 1) * D, g * D:(g + 1) * D].detach().float())
    return out


class _Objective:
    """||(W - W_hat) X^T||^2 = tr(E H E^T) with H = X^T X, or plain ||E||^2 when H is None."""

    def __init__(self, W: torch.Tensor, H: torch.Tensor | None):
        self.W, self.H = W, H
        self.total = self(torch.zeros_like(W))

    def apply(self, E: torch.Tensor) -> torch.Tensor:
        return E if self.H is None else E @ self.H

    def __call__(self, W_hat: torch.Tensor) -> float:
        E = self.W - W_hat
        return float((self.apply(E) * E).sum())

    def rel(self, W_hat: torch.Tensor) -> float:
        return self(W_hat) / max(self.total, 1e-30)


def _update_codebooks(obj: _Objective, codes: torch.Tensor, cb: torch.Tensor, s: torch.Tensor, cg_iters: int, ridge: float) -> torch.Tensor:
    """Least squares for the codebooks with codes and scales fixed: min_C tr(E H E^T).

    Plain MSE: the normal equations separate per dimension and are solved in closed form
    (an (M K) x (M K) system, 8 right-hand sides). With H they couple every dimension and group;
    they are solved matrix-free by preconditioned conjugate gradient started at the current
    codebooks (every CG step lowers the objective, so the update never makes it worse).
    """
    n_out, G, M = codes.shape
    idx = (codes.long() + torch.arange(M, device=codes.device) * K).reshape(n_out * G, M)
    w_s = s.repeat_interleave(G)  # scale of every group
    if obj.H is None:
        A = torch.zeros(M * K, M * K, dtype=cb.dtype, device=cb.device)
        s2 = (w_s * w_s)[:, None].expand(-1, M * M).reshape(-1)
        A.index_put_((idx[:, :, None].expand(-1, M, M).reshape(-1), idx[:, None, :].expand(-1, M, M).reshape(-1)), s2, accumulate=True)
        rhs = torch.zeros(M * K, D, dtype=cb.dtype, device=cb.device)
        wv = obj.W.reshape(n_out * G, D) * w_s[:, None]
        for m in range(M):
            rhs.index_add_(0, idx[:, m], wv)
        reg = ridge * A.diagonal().mean().clamp_min(1e-12)
        A.diagonal().add_(reg)
        rhs += reg * cb.reshape(M * K, D)  # pull unused entries toward where they are
        return torch.linalg.solve(A, rhs).reshape(M, K, D)

    def expand(theta):  # codebooks -> W_hat
        return _decode(codes, theta, s)

    def adjoint(R):  # (out, in) -> codebook space: sum over groups of s * R_group into each code used
        rv = (R.reshape(n_out, G, D) * s[:, None, None]).reshape(n_out * G, D)
        out = torch.zeros(M * K, D, dtype=R.dtype, device=R.device)
        for m in range(M):
            out.index_add_(0, idx[:, m], rv)
        return out.reshape(M, K, D)

    # Jacobi preconditioner from the block diagonal of H (exact diagonal when groups share no code).
    Hd = obj.H.diagonal().reshape(G, D)
    diag = torch.zeros(M * K, D, dtype=cb.dtype, device=cb.device)
    dv = (Hd[None] * (s * s)[:, None, None]).reshape(n_out * G, D)
    for m in range(M):
        diag.index_add_(0, idx[:, m], dv)
    reg = ridge * diag.mean().clamp_min(1e-12)
    diag = (diag + reg).reshape(M, K, D)

    def A(theta):
        return adjoint(obj.apply(expand(theta))) + reg * theta

    theta = cb.clone()
    r = adjoint(obj.apply(obj.W)) + reg * cb - A(theta)
    z = r / diag
    p = z.clone()
    rz = (r * z).sum()
    for _ in range(cg_iters):
        Ap = A(p)
        pAp = (p * Ap).sum()
        if pAp <= 0:
            break
        alpha = rz / pAp
        theta = theta + alpha * p
        r = r - alpha * Ap
        z = r / diag
        rz_new = (r * z).sum()
        if rz_new <= 1e-30:
            break
        p = z + (rz_new / rz) * p
        rz = rz_new
    return theta


def _update_scales(obj: _Objective, codes: torch.Tensor, cb: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Per-row least squares for the scale with codes and codebooks fixed: s_o = <w_o, u_o>_H / <u_o, u_o>_H."""
    U = _decode(codes, cb, torch.ones_like(s))
    UH = obj.apply(U)
    num, den = (UH * obj.W).sum(1), (UH * U).sum(1)
    return torch.where(den > 1e-30, num / den.clamp_min(1e-30), s)


def quantize_additive(W: torch.Tensor, M: int = 2, X: torch.Tensor | None = None, H: torch.Tensor | None = None,
                      iters: int = 6, beam: int = 4, seed: int = 0, kmeans_iters: int = 10, cg_iters: int = 12,
                      ridge: float = 1e-4, progress: bool = True) -> tuple[AdditiveTensor, AdditiveReport]:
    """AQLM-style additive quantization of an (out, in) weight into M codebooks of 256 x 8.

    Objective: plain ||W - W_hat||^2, or with calibration inputs X (n, in) or H = X^T X (in, in)
    the output error ||(W - W_hat) X^T||^2 = tr(E H E^T). Per-output-channel scales (init: row
    RMS), codebooks from residual k-means, then ``iters`` rounds of (a) beam search over codes,
    group by group when H couples the groups (Gauss-Seidel, the others' error held fixed), all
    groups at once for plain MSE; (b) least squares for the codebooks; (c) least squares for the
    scales. Every step is an exact or monotone minimization, so the objective does not increase.
    Runs on W's device; deterministic for a seed.
    """
    t0 = time.perf_counter()
    check_M(M)
    if not isinstance(W, torch.Tensor) or W.dim() != 2:
        raise ValueError(f"W must be a 2-D tensor (out_features, in_features), got {getattr(W, 'shape', type(W).__name__)}")
    check_in_features(W.shape[1], M)
    check_finite(W)
    if X is not None and H is not None:
        raise ValueError("pass X or H, not both")
    dev = W.device
    Wf = W.detach().float()
    n_out, n_in = Wf.shape
    G = n_in // D
    if X is not None:
        check_finite(X, "X")
        if X.dim() != 2 or X.shape[1] != n_in:
            raise ValueError(f"X must be (n_samples, {n_in}), got {tuple(X.shape)}")
        Xf = X.detach().to(dev, torch.float32)
        H = Xf.T @ Xf
    if H is not None:
        check_finite(H, "H")
        if tuple(H.shape) != (n_in, n_in):
            raise ValueError(f"H must be ({n_in}, {n_in}), got {tuple(H.shape)}")
        H = H.detach().to(dev, torch.float32)
        H = (H + H.T) / 2
        H = H + 1e-6 * H.diagonal().mean().clamp_min(1e-12) * torch.eye(n_in, device=dev)  # dampening: H must be definite
    obj = _Objective(Wf, H)
    gen = torch.Generator().manual_seed(seed)

    # Init: row-RMS scales, residual k-means codebooks.
    s = Wf.pow(2).mean(1).sqrt().clamp_min(1e-8)
    V = (Wf / s[:, None]).reshape(n_out * G, D)
    res = V.clone()
    cbs, labs = [], []
    for _ in range(M):
        c, lab = _kmeans(res, K, kmeans_iters, gen)
        cbs.append(c)
        labs.append(lab)
        res = res - c[lab]
    cb = torch.stack(cbs)
    codes = torch.stack(labs, 1).reshape(n_out, G, M).to(torch.int16)
    curve = [obj.rel(_decode(codes, cb, s))]

    from tqdm.auto import tqdm

    bar = tqdm(range(iters), desc=f"additive M={M}", disable=not progress, leave=False)
    for _ in bar:
        # (a) codes
        if H is None:
            codes = recode(codes, Wf, codebooks=cb, scales=s, beam=beam, chunk=max(1, 2**22 // (beam * K)))
        else:
            W_hat = _decode(codes, cb, s)
            R = (Wf - W_hat) @ H  # (out, in): H-weighted error, kept current group by group
            for g in torch.randperm(G, generator=gen).tolist():
                sl = slice(D * g, D * g + D)
                Hg = H[sl, sl]
                old = W_hat[:, sl]
                b = R[:, sl] + old @ Hg  # the group's linear term with its own reconstruction taken out
                new_codes = _beam_codes(b, s, Hg, cb, codes[:, g], beam)
                codes[:, g] = new_codes
                new = cb[torch.arange(M, device=dev), new_codes.long()].sum(1) * s[:, None]
                R -= (new - old) @ H[sl, :]
                W_hat[:, sl] = new
        # (b) codebooks, (c) scales
        cb = _update_codebooks(obj, codes, cb, s, cg_iters, ridge)
        s = _update_scales(obj, codes, cb, s)
        curve.append(obj.rel(_decode(codes, cb, s)))
        bar.set_postfix(rel_err=f"{curve[-1]:.4g}")
    t = AdditiveTensor(codes.to(torch.uint8), cb.to(torch.float16), s.to(torch.float16))
    W16 = t.dequantize(torch.float32)
    rep = AdditiveReport(M=M, iters_run=iters, objective="mse" if H is None else "calibration", rel_err_curve=curve,
                         rel_err=obj.rel(W16), rel_mse=float(((Wf - W16) ** 2).sum() / (Wf**2).sum().clamp_min(1e-30)),
                         max_abs_err=float((Wf - W16).abs().max()), seconds=time.perf_counter() - t0)
    return t, rep


# -- the fused GEMV --------------------------------------------------------------------------
SMEM_OPTIN_FLOOR = 48 * 1024  # shared memory every block gets without opting in
MAX_CPS = 8  # ptxas (sm_90) keeps the 2 x cps x 4-word code ring in registers up to cps=12 (152 regs); 8 leaves 120 for 2 blocks an SM
CHUNK_LUT_BYTES = CHUNK_BYTES * K * 4  # fp32 table for one 16-byte chunk column (16 codes) of one batch row: 16 KiB
_kernel_cache: dict = {}
# Device functions that take the code ring must be inlined, or the ring goes to local memory.
# (The simulator's jit has no such option.)


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of (out, in/8, M) uint8 codes, as :func:`trapetum.codebook.tile` lays
    out scalar codes: rows padded to a multiple of 32, then
    tiled[((rb * nchunks + j) * 32 + lane) * 16 + t] = row (rb * 32 + lane)'s code byte j * 16 + t,
    returned as int32 words: a warp's 16-byte-a-lane load of chunk j of row-block rb is 512
    contiguous bytes. :func:`trapetum.codebook.untile` is the inverse."""
    n_out = codes.shape[0]
    flat = codes.reshape(n_out, -1)
    nbytes = flat.shape[1]
    rbs = -(-n_out // ROW_BLOCK)
    if rbs * ROW_BLOCK != n_out:
        flat = torch.cat([flat, flat.new_zeros(rbs * ROW_BLOCK - n_out, nbytes)])
    t = flat.reshape(rbs, ROW_BLOCK, nbytes // CHUNK_BYTES, CHUNK_BYTES).permute(0, 2, 1, 3).contiguous()
    return t.view(torch.int32).reshape(-1)


def lut_stride(M: int, mma: bool) -> int:
    """Table entries a (batch row, group): M x 256, plus 4 of padding under the mma build (M x 256
    is a multiple of 32, so without it the 4 columns of an mma's D fragment would store to one bank)."""
    return M * K + (4 if mma else 0)


TABLES = {"fp32": 4, "fp16": 2}  # table entry types and their bytes
# The streaming and chunk kernels' tables: entries below 2**13 (two powers of two more headroom), so the four
# lookups of a code word sum in fp16 (gemv.half_sum4) below 2**15.
STREAM_FP16_HEADROOM = FP16_HEADROOM - 2


def check_table(table: str, mma: bool) -> None:
    """A table entry type the kernel has, with the build it needs."""
    if table not in TABLES:
        raise ValueError(f"table must be one of {sorted(TABLES)}, got {table!r}")
    if table == "fp16" and not mma:
        raise ValueError("an fp16 table needs the tensor-core build (build='mma')")


def lut_bytes(M: int, bt: int, cps: int, mma: bool, table: str = "fp32") -> int:
    """Dynamic shared memory of a block: the table of bt batch rows x cps chunk columns."""
    return TABLES[table] * bt * cps * groups_per_chunk(M) * lut_stride(M, mma)


def residual_add(post: str):
    """The kernels' ``with_res(v, res, b, row)``: v + res[b, row] where ``post`` is "add" (the decode
    step's residual, read and written back as y by the same thread, so res may be y), else v."""
    ADD = post == "add"

    @cuda.jit(device=True, **INLINE)
    def with_res(v, res, b, row):
        if ADD:
            v += float32(res[b, row])
        return v

    return with_res


@cuda.jit(device=True, **INLINE)
def slices_irms(ws, nsplit, b, n, eps):
    """1 / rms of batch row ``b`` (``n`` inputs) from the sums of squares its ``nsplit`` K-slices left
    in the workspace's last column (:func:`table_ws_columns`), for the block that finishes a row-group.
    Every warp loads a slice a lane (one L2 round trip, not nsplit / 8 of them) and sums them in the
    same order, so every thread gets the same value."""
    v = float32(0.0)
    for sp in range(cuda.laneid, nsplit, 32):
        v += load_cg(ws, sp, b, ws.shape[2] - 1)
    return inv_rms(warp_sum_f32(v), n, eps)


def table_ws_columns(n_rows: int, pre: str) -> int:
    """Columns of the table kernel's K-slice workspace: a partial an output row, and with pre='rms' one
    more, where each K-slice leaves its sum of squares of x."""
    return n_rows + (pre == "rms")


def additive_kernel(M: int, B: int, bt: int, warps: int, RB: int, cps: int, mma: bool = False, table: str = "fp32",
                    pre: str = "", post: str = ""):
    """The fused additive GEMV for M codebooks and batch B (compiled on first use, per plan).

    Grid (row-groups of RB row-blocks, K-slices, batch tiles of bt). A block:
    1. issues the loads of its warps' first row-block codes (cps chunks a lane),
    2. builds LUT[b][g][m][k] = dot(codebooks[m, k], x[b, 8g:8g+8]) in fp32 dynamic shared memory
       for its bt batch rows and its G = cps * 16 / M groups (thread t owns entries m*256+k = t + i*nt,
       so stores are conflict-free; the codebook rows sit in registers, x is a broadcast load),
    3. each warp streams its row-blocks (lane = row), the next row-block's chunks loading while the
       current one is summed: a byte of code is (w >> 8t) masked into a byte offset, one shared
       load and one add a lookup, no shuffles;
    4. multiplies by the row's scale and writes y (plus bias), or its K-slice's partial to the fp32
       workspace; the last block of a row-group to finish sums the partials (atomic counter it
       resets, so the launch replays in a CUDA graph).
    With ``mma``, step 2 runs on the tensor cores, as the CUDA C++ kernel's does: the table is
    codebooks (M x 256 entries x 8) times the block's slice of x (8 x bt G columns, fp16 straight
    from x: products of fp16 are exact in fp32), one ``mma.m16n8k8`` for 16 entries x 8 columns,
    where the scalar build spends eight multiply-adds and a store an entry and column.
    ``table="fp16"`` (mma build only) halves the table, so more blocks share an SM and a warp's
    random lookups hit fewer distinct words a bank, as the CUDA C++ kernel's fp16 plans. An entry
    can exceed fp16's range (|x| in the thousands), so each block scales its slice's table by 2**-s,
    s the least that keeps every entry below 2**15 whatever the codes (from max |x| over the slice,
    one warp-wide max, and ``cbexp``: every codebook entry's L1 norm is below 2**cbexp), and
    multiplies its sums by 2**s. s is 0 for ordinary activations; the sums stay fp32.
    The decode step's operations fuse as into :func:`trapetum.gemv.lut_kernel` (mma build only: they
    act on x where the build reads it, as fp16 B fragments):
    ``pre="rms"``: y = (1 / rms) W (g * x). 1 / rms is a scalar a row, so it stays off the table: the
    build takes g * x in fp32, scaled by a power of two a batch row (max below 2) before it becomes
    fp16, and every warp sums its slice's squares from the words it already holds (no read of the
    whole row, no barrier before the build; NOTES, session 46). With one K-slice the block applies
    1 / rms where it writes y; with several, each slice leaves its sum of squares in the workspace's
    last column and the last block takes 1 / rms of their sum as it adds the partials.
    ``pre="silu"``: x32 = [a | b], x = silu(a) * b, rounded as transformers' fp16 Llama rounds it;
    ``post="add"``: y = res + W x (res may be y itself).
    Arguments: x32 (B, in/2) int32 view of fp16 x; tiled int32 codes; cb32 (M*256*4,) int32 view of
    the fp16 codebooks; scales, bias (out,) fp16; y (B, out) fp16; ws (ksplit, B, out_pad) fp32
    (pre="rms": out_pad + 1 columns, see :func:`table_ws_columns`);
    counters int32 (row-groups x batch tiles); n_out; rbs (row-blocks); nchunks (chunks a row);
    cbexp (:func:`codebook_exponent`; unused by fp32 tables); g32 (the norm weight's int32 view),
    res, eps: the fused operands (unread without them).
    """
    check_table(table, mma)
    check_ops(pre, post)
    if (pre or post) and not mma:
        raise ValueError("fused operations need the tensor-core table build (build='mma')")
    RMS, SILU = pre == "rms", pre == "silu"
    half = table == "fp16"
    key = (M, B, bt, warps, RB, cps, mma, table, pre, post)
    if key in _kernel_cache:
        return _kernel_cache[key]
    gpc = groups_per_chunk(M)
    G = cps * gpc
    nt = warps * 32
    pairs = M * K
    ppt = -(-pairs // nt)
    regs = cps * 4
    ring_size = 2 * regs
    cbv_size = 1 if mma else ppt * 8
    PS = lut_stride(M, mma)
    BG = bt * G  # table columns
    NT = -(-BG // 8)  # mma N-tiles
    NT2 = 2 * NT
    TILES = pairs // 16  # mma M-tiles
    TPW = -(-TILES // warps)
    afr_size = 2 * TPW if mma else 1  # A fragments a lane holds
    mma_tile = mma_table_tile(NT, BG, PS, half)
    zero = int32(0)
    esize = TABLES[table]
    mask = uint32(255 * esize)
    lshift = uint32(esize.bit_length() - 1)  # byte offset of entry k: k << lshift

    @cuda.jit(device=True, **INLINE)
    def fetch(dst, off, tiled, rb, rbs, nchunks, j0, j1):
        base = (rb * nchunks * 32 + cuda.laneid) * 4
        for c in range(cps):
            o = off + 4 * c
            if rb < rbs and j0 + c < j1:
                dst[o], dst[o + 1], dst[o + 2], dst[o + 3] = load16(tiled, base + (j0 + c) * 128)
            else:
                dst[o], dst[o + 1], dst[o + 2], dst[o + 3] = zero, zero, zero, zero

    @cuda.jit(device=True, **INLINE)
    def byte_offset(w, t):
        # Byte t of word w, times the entry size (the entry's byte offset): two integer ops.
        if t == 0:
            return (w << lshift) & mask
        return (w >> (uint32(8 * t) - lshift)) & mask

    @cuda.jit(device=True, **INLINE)
    def lookup(lut, off):
        if half:
            return load_half_byte_offset(lut, off)
        return load_byte_offset(lut, off)

    @cuda.jit(device=True, **INLINE)
    def sum_chunks(ring, off, lut, acc, j0, j1):
        for c in range(cps):
            if j0 + c < j1:
                for q in range(4):
                    w = uint32(ring[off + 4 * c + q])
                    for t in range(4):
                        gi = (4 * q + t) // M
                        m = (4 * q + t) % M
                        o = byte_offset(w, t)
                        for bb in range(bt):
                            acc[bb] += lookup(lut, uint32(((bb * G + c * gpc + gi) * PS + m * K) * esize) + o)

    with_res = residual_add(post)

    @cuda.jit(device=True, **INLINE)
    def row_block(ring, cur, nxt, lut, acc, tiled, scales, bias, y, ws, r, rb0, rbs, nchunks, j0, j1, b0, split, nsplit, n_out, fac, res):
        # Prefetch the warp's next row-block into slot nxt, sum this one's (slot cur), then
        # 4. scale (fac: each batch row's factor, see build_mma) and write y, or this K-slice's partial.
        nr = r + warps
        fetch(ring, nxt, tiled, rb0 + nr if nr < RB else rbs, rbs, nchunks, j0, j1)
        for bb in range(bt):
            acc[bb] = float32(0.0)
        sum_chunks(ring, cur, lut, acc, j0, j1)
        rb = rb0 + r
        row = rb * 32 + cuda.laneid
        if rb < rbs and row < n_out:
            sc = float32(scales[row])
            for bb in range(bt):
                if b0 + bb < B:
                    if nsplit == 1:
                        y[b0 + bb, row] = with_res(acc[bb] * (sc * fac[bb]) + float32(bias[row]), res, b0 + bb, row)
                    else:
                        ws[split, b0 + bb, row] = acc[bb] * (sc * fac[bb])

    @cuda.jit(device=True, **INLINE)
    def load_a(afr, cb32, tid):
        # The A fragments of the warp's M-tiles (the same every launch), all in flight at once: loaded
        # inside the build loop, each tile waited for its own L2 round trip before its mma.
        lane = uint32(tid) & uint32(31)
        e = uint32(16) * (uint32(tid) >> uint32(5)) + (lane >> uint32(2))
        t = lane & uint32(3)
        for k in range(TPW):
            if e < uint32(pairs):
                afr[2 * k] = cb32[uint32(4) * e + t]
                afr[2 * k + 1] = cb32[uint32(4) * e + uint32(32) + t]
            e += uint32(16 * warps)

    @cuda.jit(device=True, **INLINE)
    def column(n, gl):
        # N-tile n's column for lane group gl: (c, batch row c / G, group c % G); signed, as numba
        # types int64 + uint64 as float64.
        c = uint32(8 * n) + gl
        if bt == 1:
            return c, int32(0), int32(c)
        return c, int32(c // uint32(G)), int32(c % uint32(G))

    @cuda.jit(device=True, **INLINE)
    def rms_fragments(bx, x32, g32, b0, g0, g1, gl, t, fac, ssq):
        # pre="rms": bx = fp16(g * x / 2**s_b), s_b a batch row's least power of two keeping its max
        # below 2 (g * x in the thousands would overflow fp16; 1 / rms, which would have kept it small,
        # multiplies the row sums instead); fac[b] *= 2**s_b; ssq[b] = the slice's sum of x**2, every
        # lane holding it (each of x's words sits in exactly one lane's fragments).
        px = cuda.local.array(NT2, float32)
        mx = cuda.local.array(bt, uint32)  # bits of the largest |g * x|, then of the row's 2**-s
        for bb in range(bt):
            mx[bb] = uint32(0)
            ssq[bb] = float32(0.0)
        for n in range(NT):
            c, bb, g = column(n, gl)
            px[2 * n] = px[2 * n + 1] = float32(0.0)
            if c < uint32(BG) and b0 + bb < B and g0 + g < g1:
                wi = 4 * (g0 + g) + int32(t)
                a, b = half2_to_float2(x32[b0 + bb, wi])
                ga, gb = half2_to_float2(g32[wi])
                ssq[bb] += a * a + b * b
                px[2 * n], px[2 * n + 1] = a * ga, b * gb
                mx[bb] = max(mx[bb], max(float_bits(abs(px[2 * n])), float_bits(abs(px[2 * n + 1]))))
        for bb in range(bt):
            ssq[bb] = warp_sum_f32(ssq[bb])
            # the max's biased exponent E: max < 2**(E - 126) = 2**(s + 1); s kept where 2**±s is normal
            s = min(max(int32(warp_max_u32(mx[bb]) >> uint32(23)) - 127, -100), 100)
            fac[bb] *= bits_float(uint32(127 + s) << uint32(23))
            mx[bb] = uint32(127 - s) << uint32(23)
        for n in range(NT):
            c, bb, g = column(n, gl)
            f = bits_float(mx[bb]) if c < uint32(BG) else float32(0.0)
            bx[n] = float2_to_half2(px[2 * n] * f, px[2 * n + 1] * f)

    @cuda.jit(device=True, **INLINE)
    def build_mma(lut, x32, afr, b0, g0, g1, tid, cbexp, g32, fac, ssq):
        # Lane (g, t) = (lane / 4, lane % 4). B fragment of N-tile n: column c = 8n + g = (batch row
        # c / G, group c % G), x's 32-bit word t of that group (dimensions 2t, 2t + 1), zero past
        # the slice or the batch. A fragment of M-tile i: words t of entries 16i + g and 16i + g + 8.
        # Multiplies fac (a batch row's factor for its sums, 1 on entry) by 2**s (fp16 tables, see above).
        lane = uint32(tid) & uint32(31)
        gl = lane >> uint32(2)
        t = lane & uint32(3)
        bx = cuda.local.array(NT, int32)
        if RMS:
            rms_fragments(bx, x32, g32, b0, g0, g1, gl, t, fac, ssq)
        else:
            for n in range(NT):
                c, bb, g = column(n, gl)
                bx[n] = 0
                if c < uint32(BG) and b0 + bb < B and g0 + g < g1:
                    wi = 4 * (g0 + g) + int32(t)
                    w = x32[b0 + bb, wi]
                    if SILU:
                        w = silu_word(w, x32[b0 + bb, (x32.shape[1] >> 1) + wi])
                    bx[n] = w
        up = float32(1.0)
        down = float32(1.0)
        if half:
            # Every warp holds the whole slice of x in its fragments, so each finds the same s alone.
            hx = uint32(0)
            for n in range(NT):
                hx = half2_abs_bits(hx, bx[n])
            up, down = fp16_table_scale(hx, cbexp, FP16_HEADROOM)
        e = uint32(16) * (uint32(tid) >> uint32(5)) + gl
        for k in range(TPW):
            if e < uint32(pairs):  # warp-uniform: mma needs all 32 lanes
                mma_tile(lut, uint32(0), e, t, afr[2 * k], afr[2 * k + 1], bx, down)
            e += uint32(16 * warps)
        for bb in range(bt):
            fac[bb] *= up

    @cuda.jit
    def kernel(x32, tiled, cb32, scales, bias, y, ws, counters, n_out, rbs, nchunks, cbexp, g32, res, eps):
        lut = cuda.shared.array(0, uint16 if half else float32)  # [b][g][m][k]
        last = cuda.shared.array(1, int32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        rb0 = cuda.blockIdx.x * RB
        split = cuda.blockIdx.y
        nsplit = cuda.gridDim.y
        b0 = cuda.blockIdx.z * bt
        j0 = split * cps
        j1 = min(j0 + cps, nchunks)

        # 1. The first row-block's codes are in flight while the table is built.
        ring = cuda.local.array(ring_size, int32)
        r = warp
        fetch(ring, 0, tiled, rb0 + r if r < RB else rbs, rbs, nchunks, j0, j1)
        afr = cuda.local.array(afr_size, int32)
        if mma:
            load_a(afr, cb32, tid)

        # 2. The table.
        g0 = j0 * gpc
        g1 = j1 * gpc
        fac = cuda.local.array(bt, float32)
        ssq = cuda.local.array(bt, float32)
        for bb in range(bt):
            fac[bb] = float32(1.0)
        if mma:
            build_mma(lut, x32, afr, b0, g0, g1, tid, cbexp, g32, fac, ssq)
        if RMS:
            for bb in range(bt):
                if b0 + bb < B:
                    if nsplit == 1:
                        fac[bb] *= inv_rms(ssq[bb], x32.shape[1] * 2, eps)
                    elif tid == 0:  # the same value from every row-group's block of this slice
                        ws[split, b0 + bb, ws.shape[2] - 1] = ssq[bb]
        cbv = cuda.local.array(cbv_size, float32)
        for i in range(0 if mma else ppt):
            p = tid + i * nt
            if p < pairs:
                w0, w1, w2, w3 = load16(cb32, p * 4)
                cbv[8 * i], cbv[8 * i + 1] = half2_to_float2(w0)
                cbv[8 * i + 2], cbv[8 * i + 3] = half2_to_float2(w1)
                cbv[8 * i + 4], cbv[8 * i + 5] = half2_to_float2(w2)
                cbv[8 * i + 6], cbv[8 * i + 7] = half2_to_float2(w3)
        for bb in range(0 if mma else bt):
            if b0 + bb < B:
                xrow = x32[b0 + bb]
                for g in range(G):
                    if g0 + g < g1:
                        w0, w1, w2, w3 = load16(xrow, (g0 + g) * 4)
                        xa, xb = half2_to_float2(w0)
                        xc, xd = half2_to_float2(w1)
                        xe, xf = half2_to_float2(w2)
                        xg, xh = half2_to_float2(w3)
                        for i in range(ppt):
                            p = tid + i * nt
                            if p < pairs:
                                v = xa * cbv[8 * i]
                                v = cuda.fma(xb, cbv[8 * i + 1], v)
                                v = cuda.fma(xc, cbv[8 * i + 2], v)
                                v = cuda.fma(xd, cbv[8 * i + 3], v)
                                v = cuda.fma(xe, cbv[8 * i + 4], v)
                                v = cuda.fma(xf, cbv[8 * i + 5], v)
                                v = cuda.fma(xg, cbv[8 * i + 6], v)
                                v = cuda.fma(xh, cbv[8 * i + 7], v)
                                lut[(bb * G + g) * PS + p] = v
        cuda.syncthreads()

        # 3. Rows: warp w owns row-blocks w, w + warps, ... of the block. The ring has two slots:
        #    the current row-block's chunks and the next one's, loading. The loop body is written
        #    out twice so that every ring index is a constant and the ring stays in registers.
        acc = cuda.local.array(bt, float32)
        while r < RB:
            row_block(ring, 0, regs, lut, acc, tiled, scales, bias, y, ws, r, rb0, rbs, nchunks, j0, j1, b0, split, nsplit, n_out, fac, res)
            r += warps
            if r < RB:
                row_block(ring, regs, 0, lut, acc, tiled, scales, bias, y, ws, r, rb0, rbs, nchunks, j0, j1, b0, split, nsplit, n_out, fac, res)
                r += warps

        cidx = cuda.blockIdx.x + cuda.gridDim.x * cuda.blockIdx.z
        if nsplit > 1 and last_to_finish(counters, cidx, nsplit, last, tid):
            for bb in range(bt):  # pre="rms": 1 / rms of the slices' sums of squares
                fac[bb] = float32(1.0)
                if RMS:
                    fac[bb] = slices_irms(ws, nsplit, min(b0 + bb, B - 1), x32.shape[1] * 2, eps)
            for i in range(tid, RB * 32 * bt, nt):
                bb = i // (RB * 32)
                row = rb0 * 32 + (i - bb * RB * 32)
                if row < n_out and b0 + bb < B:
                    v = sum_splits(ws, nsplit, b0 + bb, row)
                    if RMS:
                        v *= fac[bb]
                    y[b0 + bb, row] = with_res(v + float32(bias[row]), res, b0 + bb, row)

    _kernel_cache[key] = kernel
    return kernel


# -- the streaming kernel (M = 2, batch 1) ---------------------------------------------------
# Why another kernel: the K-split table kernel above builds a small table per block and runs one
# wave of blocks, each a chain of load -> build -> barrier -> lookups -> finish that nothing
# overlaps (NOTES, sessions 22-26), and its lanes (one a row) look up one shared table, ~3 shared
# wavefronts a random lookup. Here a block owns a set of rows over a whole K-slice (one block an SM)
# and streams the slice in chunks of 64 groups, building chunk c + 1's table on the tensor cores while
# it looks up chunk c's (two table buffers, one barrier a chunk). Lanes own groups, not rows: table word
# [entry k][codebook m][lane s] holds groups s and s + 32 of the chunk as an fp16 pair, so lane s's
# lookups all fall in bank s (one wavefront a warp-wide lookup, whatever the codes), and a lane sums
# its groups for every row of its warp, the 32 lanes' partial sums meeting once, at the end.
# Measured (NOTES, session 38): faster than the table kernel at the largest layers only; at the mid
# shapes its codes, streamed a chunk a barrier, already take most of the time without any table or lookup.
STREAM_GROUPS = 64  # groups a chunk: a table word holds groups s and s + 32
STREAM_TABLE_WORDS = K * 2 * 32  # a chunk's table: 256 entries x 2 codebooks x 32 words (64 KiB)
STREAM_X_WORDS = STREAM_GROUPS * D // 2  # a chunk's slice of x: 512 fp16 values in 256 words
STREAM_ROWS = 4  # rows a lane's 16-byte code load covers (a "quad")
CHUNK_TILES = (4, 8)  # quads a warp's tile in the chunk kernel (:func:`chunk_kernel`): 16 or 32 rows
# The most chunks the chunk kernel's cluster finish takes: 8 portably; 16 as a non-portable cluster, which sm_90 runs
# once the kernel opts in (gemv.with_shared_limit). On the H200, 13B qkv and gate_up (10 chunks), 70B qkv (16) and
# M=4 at 4096 x 14336 (16) ran 6-12 % under their global finish; 70B o and gate_up, 13B o and M=4 4096^2 ran
# slower (data/_runs/c16-probe-7a9ccf1-h200.json): the tuner times both, for plain calls only (the fused
# step's lost in the decode, AdditiveGemv._candidates). A GPU that cannot place such a cluster refuses the
# launch, and the tuner skips that candidate.
MAX_CLUSTER = 16
_stream_cache: dict = {}


def stream_quads(n_out: int) -> int:
    """Quads of rows (4 rows, one 16-byte code load a lane) an ``n_out``-row layer pads to."""
    return -(-n_out // STREAM_ROWS)


def stream_chunks(groups: int) -> int:
    """Chunks of 64 groups a row of ``groups`` groups of 8 inputs pads to."""
    return -(-groups // STREAM_GROUPS)


def stream_slices(nch: int, ksplit: int) -> tuple[int, int]:
    """(chunks a K-slice, K-slices that run) for ``ksplit`` asked of a row of ``nch`` chunks: the slices
    are evened, so 6 asked of 8 chunks run as 4 of 2."""
    cps = -(-nch // ksplit)
    return cps, -(-nch // cps)


def check_stream_shape(warps: int, slots: int) -> None:
    if 64 % warps or slots not in (2, 3):
        raise ValueError(f"streaming plan: warps must divide 64 and code slots be 2 or 3, got {warps}, {slots}")


def check_chunk_shape(warps: int, tile: int) -> None:
    if 64 % warps or tile not in CHUNK_TILES:
        raise ValueError(f"chunk plan: warps must divide 64 and a tile be {CHUNK_TILES} quads, got {warps}, {tile}")


def stream_codes(codes: torch.Tensor) -> torch.Tensor:
    """The streaming kernel's layout of (out, in/8, 2) uint8 codes, as int32 words: rows padded to
    quads of 4, groups to chunks of 64 (zero codes: their x is zero-padded, so they add nothing), and
    word ((c * quads + q) * 32 + s) * 4 + r = row 4q + r's codes of groups 64c + s and 64c + s + 32,
    bytes [m0 of g, m1 of g, m0 of g + 32, m1 of g + 32]: lane s's 16-byte load is a quad's word.
    M=4 codes are two M=2 layers over the same x, codebooks 0-1 then 2-3 (:func:`chunk_kernel`'s
    ``halves``): their two layouts, one after the other, so chunk c + nch is codebooks 2-3's chunk c."""
    n_out, G, M = codes.shape
    if M == 4:
        return torch.cat([stream_codes(codes[..., :2]), stream_codes(codes[..., 2:])])
    if M != 2:
        raise ValueError(f"the streaming layout holds M=2 or M=4 codes, got M={M}")
    nq, nch = stream_quads(n_out), stream_chunks(G)
    c = codes.new_zeros(nq * STREAM_ROWS, nch * STREAM_GROUPS, 2)
    c[:n_out, :G] = codes
    # (q, r, c, h, s, m) -> (c, q, s, r, h, m)
    t = c.reshape(nq, STREAM_ROWS, nch, 2, 32, 2).permute(2, 0, 4, 1, 3, 5).contiguous()
    return t.reshape(-1).view(torch.int32)


def unstream_codes(words: torch.Tensor, n_out: int, G: int, rows: tuple[int, int] | None = None, M: int = 2) -> torch.Tensor:
    """The inverse of :func:`stream_codes`: (out, G, M) uint8; ``rows=(r0, r1)``: only those rows
    (r0 a multiple of 4), copying only their quads."""
    if M == 4:
        half = words.numel() // 2
        return torch.cat([unstream_codes(words[:half], n_out, G, rows), unstream_codes(words[half:], n_out, G, rows)], dim=-1)
    nq, nch = stream_quads(n_out), stream_chunks(G)
    r0, r1 = (0, n_out) if rows is None else rows
    q0, q1 = r0 // STREAM_ROWS, stream_quads(r1)
    t = words.view(torch.uint8).reshape(nch, nq, 32, STREAM_ROWS, 2, 2)[:, q0:q1].permute(1, 3, 0, 4, 2, 5)
    return t.reshape((q1 - q0) * STREAM_ROWS, nch * STREAM_GROUPS, 2)[:r1 - r0, :G].contiguous()


def stream_shared_bytes(nchunks: int, ksplit: int) -> int:
    """Dynamic shared memory of a streaming block: two chunk tables and the K-slice of x."""
    return 4 * (2 * STREAM_TABLE_WORDS + -(-nchunks // ksplit) * STREAM_X_WORDS)


def _stream_parts(warps: int, tables: int, pre: str, post: str, defer_rms: bool = False):
    """The device functions the two streaming kernels share, for blocks of ``warps`` warps whose
    shared memory holds ``tables`` chunk tables and then x (``pre``: how x is staged; ``post``: how
    y is written; ``defer_rms``: pre='rms' stages g * x, un-normalised, and leaves each warp's share
    of the staged chunks' sum of squares in wsq[warp, 0], for the kernel to apply 1 / rms where it
    writes y).
    Returned, in this order:

    - ``build(sm, bfr, lc, buf, warp, lane, cbexp)``: chunk ``lc`` (of the staged x) into table
      ``buf`` (see :func:`stream_kernel`, step 2); returns the factor 2**s its sums must be multiplied by;
    - ``start(sm, x32, g32, cb32, cbo, bfr, wsq, c0, nc, tid, warp, lane, cbexp, eps)``: a block's
      prologue: the warp's B fragments ``bfr`` loaded (two codebooks from word ``cbo`` of ``cb32``), then
      (after the wait for a programmatic launch's predecessor, :func:`trapetum.gemv.launch_hooks`) chunks
      c0 .. c0 + nc - 1 of x staged (cp.async, or through registers normalised or gated) and chunk c0's
      table built in table 0; returns its factor;
    - ``ids(qpb)``: (thread, warp, lane, the block's first quad of rows);
    - ``lookup(sm, w, l0)``: the sum of code word w's four table entries (l0: the lane's byte offset of
      codebook 0, group s, in the table read);
    - ``finish(y, ws, bias, res, nsplit, qb0, nrows, n_out, tid, irms)``: the last block of a row-group adds
      the K-slices' partials of its ``nrows`` rows, times ``irms`` (1 / rms where defer_rms, else 1), the
      bias and ``post``.
    """
    RMS, SILU = pre == "rms", pre == "silu"
    nt = warps * 32
    KT = 64 // warps  # k-tiles (8 entries of one codebook) a warp builds every chunk
    XO = tables * STREAM_TABLE_WORDS  # word offset of x in shared memory
    zero = int32(0)

    @cuda.jit(device=True, **INLINE)
    def pick(w0, w1, w2, w3, r):
        lo = w1 if r & 1 else w0
        hi = w3 if r & 1 else w2
        return hi if r & 2 else lo

    @cuda.jit(device=True, **INLINE)
    def build(sm, bfr, lc, buf, warp, lane, cbexp):
        gid = lane >> uint32(2)
        t = lane & uint32(3)
        xo = uint32(XO) + uint32(lc) * uint32(STREAM_X_WORDS) + lane
        a = cuda.local.array(8, int32)
        hx = uint32(0)
        for p in range(4):  # A: x of groups 8p + gid (rows gid) and 8p + gid + 32 (rows gid + 8)
            a[2 * p] = sm[xo + uint32(32 * p)]
            a[2 * p + 1] = sm[xo + uint32(128 + 32 * p)]
        for k in range(8):
            hx = half2_abs_bits(hx, a[k])
        # Every warp holds the whole chunk of x in its A fragments, so each finds the same s alone.
        up, down = fp16_table_scale(hx, cbexp, STREAM_FP16_HEADROOM)
        if up > float32(1.0):
            for k in range(8):
                lo, hi = half2_to_float2(a[k])
                a[k] = float2_to_half2(lo * down, hi * down)
        wb = (uint32(buf) << uint32(14)) + (t << uint32(7)) + gid  # entry 2t's word of slot gid
        wd = cuda.local.array(8, int32)
        for j in range(KT):
            kt = uint32(warp + j * warps)
            for p in range(4):
                d0, d1, d2, d3 = mma_m16n8k8(a[2 * p], a[2 * p + 1], bfr[j])
                wd[2 * p] = float2_to_half2(d0, d2)  # entry k0 + 2t, slot 8p + gid: groups s, s + 32
                wd[2 * p + 1] = float2_to_half2(d1, d3)  # entry k0 + 2t + 1
            # kt = m * 32 + k0 / 8: word (k0 << 6) | (m << 5) = ((kt & 31) << 9) | ((kt >> 5) << 5)
            kb = wb + ((kt & uint32(31)) << uint32(9)) + ((kt >> uint32(5)) << uint32(5))
            for i in range(4):
                r = (t + uint32(i)) & uint32(3)
                for e in range(2):
                    sm[kb + uint32(64 * e) + (r << uint32(3))] = pick(wd[e], wd[2 + e], wd[4 + e], wd[6 + e], r)
        return up

    row_sumsq, _, irms_of = rms_sums(1, warps)

    @cuda.jit(device=True, **INLINE)
    def stage_x(sm, x32, g32, irms, c0, nc, tid, wsq):
        # Returns a deferred norm's largest |g x| over this thread's words, in fp32 (see start), else 0.
        xrow = x32[0]
        nx = (xrow.shape[0] >> 1) if SILU else xrow.shape[0]  # x's words (silu: a's; b's follow)
        nxw = nc * STREAM_X_WORDS
        ssq = float32(0.0)
        big = float32(0.0)
        for i in range(tid * 4, nxw, nt * 4):
            gw = c0 * STREAM_X_WORDS + i
            if gw < nx:  # in_features is a multiple of 8: a 4-word piece is all in or all out
                if RMS or SILU:
                    w0, w1, w2, w3 = load16(xrow, gw)
                    for k in range(4):
                        w = w0 if k == 0 else w1 if k == 1 else w2 if k == 2 else w3
                        if RMS:
                            if defer_rms:
                                a, b = half2_to_float2(w)
                                ssq += a * a + b * b
                                c, d = half2_to_float2(g32[gw + k])
                                big = max(big, abs(a * c), abs(b * d))
                            w = rms_word(w, g32[gw + k], irms)
                        else:
                            w = silu_word(w, xrow[nx + gw + k])
                        sm[XO + i + k] = w
                else:
                    copy16_async(sm, XO + i, xrow, gw)
            else:
                sm[XO + i], sm[XO + i + 1], sm[XO + i + 2], sm[XO + i + 3] = zero, zero, zero, zero
        if RMS and defer_rms:  # a scalar, not rms_sums' warp_sums (its array cost the prologue ~90 SASS instructions)
            v = warp_sum_f32(ssq)
            if cuda.laneid == 0:
                wsq[tid // 32, 0] = v
        return big

    @cuda.jit(device=True, **INLINE)
    def warp_big(big, tid, wsq):
        # The warp's largest |g x| (stage_x's per-thread ``big``) into wsq[:, 1], for shift_of after a
        # barrier. Every thread calls it.
        mb = warp_max_u32(float_bits(big))  # a non-negative float's order is its bits'
        if cuda.laneid == 0:
            wsq[tid // 32, 1] = bits_float(mb)

    @cuda.jit(device=True, **INLINE)
    def shift_of(wsq):
        # The k for which every |g x| of the staged chunks, times 2**-k, stays below 2**14 (fp16 then
        # holds it and the build's own scale covers the table), from the warps' largest |g x| that
        # warp_big left in wsq[:, 1]
        big = float32(0.0)
        for w in range(nt // 32):
            big = max(big, wsq[w, 1])
        return max(int32(float_bits(big) >> uint32(23)) - 140, 1)  # big < 2**(e - 126): times 2**-(e - 140) < 2**14

    @cuda.jit(device=True, **INLINE)
    def load_bfr(bfr, cb32, cbo, warp, lane):
        gid = lane >> uint32(2)
        t = lane & uint32(3)
        for j in range(KT):  # B of k-tile kt: entry (kt & 31) * 8 + gid of codebook kt >> 5, word t
            kt = uint32(warp + j * warps)
            bfr[j] = cb32[cbo + (((kt >> uint32(5)) << uint32(8)) + ((kt & uint32(31)) << uint32(3)) + gid) * uint32(4) + t]

    wait, _ = launch_hooks()

    @cuda.jit(device=True, **INLINE)
    def start(sm, x32, g32, cb32, cbo, bfr, wsq, c0, nc, tid, warp, lane, cbexp, eps):
        # A block's prologue, its first code loads already issued: the B fragments; then, once the
        # launch before has finished (programmatic launch: codes and codebooks are weights, x is its
        # output), chunks c0 .. c0 + nc - 1 of x staged (pre='rms': after the whole row's sum of
        # squares) and chunk c0's table built in table 0; returns that table's factor (build's).
        load_bfr(bfr, cb32, cbo, warp, lane)
        wait()
        irms = float32(1.0)
        if RMS and not defer_rms:
            row_sumsq(x32, wsq, tid, warp)
            cuda.syncthreads()
            irms = irms_of(wsq, 0, x32[0].shape[0] * 2, eps)
        # pre='rms' (deferred): fp16(g * x) un-normalised can overflow where LlamaRMSNorm's normalised x
        # would not (|g x| from 65520 up). The barrier after staging reports that as an OR; then the block
        # stages fp16(g * fp16(x 2**-k)) instead, k from the warps' largest |g x| (wsq[:, 1], written
        # before that barrier), and its sums are multiplied by 2**k. The restage is the same call site
        # in a second pass, not a branch of its own: with a second inlined stage_x under the flag,
        # ptxas (sm_90) kept the table's shared base out of uniform registers for the whole kernel, and
        # every lookup paid an IMAD (04bc3b8: the 70B gate_up launch +8 us on the H200). Which forms
        # keep it is ptxas's choice, not a rule: check the SASS (LDS [R+UR]) after changing this.
        shifted = False
        scale = irms
        for attempt in range(2):
            big = stage_x(sm, x32, g32, scale, c0, nc, tid, wsq)
            async_wait_all()
            if not (RMS and defer_rms):
                break
            if attempt == 0:
                warp_big(big, tid, wsq)
            if cuda.syncthreads_or(int32(big >= float32(65520.0))) == 0:
                break
            shifted = True
            scale = bits_float(uint32(127 - shift_of(wsq)) << uint32(23))
        cuda.syncthreads()  # (after an OR barrier too: without it ptxas gave up the uniform base again)
        # fp16 entries: each chunk's table is scaled by 2**-s, s the least that keeps every entry below
        # 2**13 (STREAM_FP16_HEADROOM) whatever the codes (from max |x| over the chunk and cbexp, as in
        # additive_kernel; s is 0 for ordinary activations), and its sums multiplied by 2**s.
        up = build(sm, bfr, 0, 0, warp, lane, cbexp)
        if shifted:  # k again from wsq[:, 1] (only a flag lives through the build)
            up *= bits_float(uint32(127 + shift_of(wsq)) << uint32(23))
        cuda.syncthreads()
        return up

    @cuda.jit(device=True, **INLINE)
    def ids(qpb):
        # (thread, warp, lane, the block's first quad of rows)
        tid = cuda.threadIdx.x
        return tid, tid // 32, uint32(tid) & uint32(31), cuda.blockIdx.x * qpb

    @cuda.jit(device=True, **INLINE)
    def quad(codes, c, q, nq, lane, ok):
        if ok:
            # read once: past L1 (session 38: -5 % at 4096 x 14336, -20 % at 16384 x 53248 against ld.global)
            return load16_stream(codes, ((uint32(c) * uint32(nq) + uint32(q)) * uint32(32) + lane) * uint32(4))
        return zero, zero, zero, zero

    @cuda.jit(device=True, **INLINE)
    def lookup(sm, w, l0):
        # byte 0 -> bits 8..15; codebook 1; the high half: group s + 32 (codebooks 0 and 1)
        o0, o1 = prmt(w, l0, uint32(0x7604)), prmt(w, l0 | uint32(128), uint32(0x7614))
        o2, o3 = prmt(w, l0 | uint32(2), uint32(0x7624)), prmt(w, l0 | uint32(130), uint32(0x7634))
        if warps <= 8:  # summed in fp16 (entries below 2**13: STREAM_FP16_HEADROOM), widened once
            return half_sum4(sm, o0, o1, o2, o3)
        # 16 warps (64 registers): the fp16 sums took ptxas from 8 bytes spilled outside the tile loop to 44
        # with 10 spill loads and stores in it
        v = load_half_byte_offset(sm, o0)
        v += load_half_byte_offset(sm, o1)
        v += load_half_byte_offset(sm, o2)
        v += load_half_byte_offset(sm, o3)
        return v

    with_res = residual_add(post)

    @cuda.jit(device=True, **INLINE)
    def finish(y, ws, bias, res, nsplit, qb0, nrows, n_out, tid, irms):
        for i in range(tid, nrows, nt):
            row = qb0 * STREAM_ROWS + i
            if row < n_out:
                y[0, row] = with_res(sum_splits(ws, nsplit, 0, row) * irms + float32(bias[row]), res, 0, row)

    return build, start, ids, lookup, finish


def stream_kernel(warps: int, QW: int, D2: int, pre: str = "", post: str = ""):
    """The streaming additive GEMV (M = 2, batch 1; see the comment above ``STREAM_GROUPS``) for
    blocks of ``warps`` warps, each warp owning up to ``QW`` quads of rows, and ``D2`` code slots a
    warp (chunks c + 1 .. c + D2 - 1 load while chunk c is summed). ``pre`` / ``post``: the decode
    step's fused operations, as :func:`additive_kernel` takes them, applied where x is staged
    (``"rms"``: the block first sums the squares of the whole row; ``"silu"``: x32 = [a | b]) and
    where y is written (``"add"``: y = res + W x, res may be y itself).

    Grid (row-groups, K-slices). A block:
    1. copies its K-slice of x to shared memory (cp.async, zeros past in_features), loads its first
       chunks' codes (``ld.global.nc``, past L1) and its warps' B fragments (codebook entries, the
       same every chunk);
    2. builds chunk 0's table: T[k][m][s] = (x_g . C_m[k], x_{g+32} . C_m[k]) for g = 64c + s, one
       ``mma.m16n8k8`` for 8 groups (and their partners 32 on) x 8 entries; lane (g, t) stores its
       fragment's words rotated by t (three selects a word) so a warp's 32 stores fall in 32 banks.
       Entries are fp16, each chunk's scaled by its own 2**-s (s from the chunk's max |x|, which
       every warp finds from its A fragments, as :func:`additive_kernel` does a K-slice's) and its
       sums by 2**s;
    3. for every chunk: loads chunk c + D2 - 1's codes, builds chunk c + 1's table into the other
       buffer, looks up chunk c (a code byte moved into a lane's table address by one byte permute),
       one barrier;
    4. sums each row's 32 lane partials (shuffles), scales, and writes y, or with a K-split its
       partial, the last block of the row-group summing them (as :func:`additive_kernel`).
    Arguments: x32 (1, in/2) int32 view of fp16 x; codes (:func:`stream_codes`); cb32 (2*256*4,)
    int32 view of the fp16 codebooks; scales, bias (out,) fp16; y (1, out) fp16; ws (ksplit, 1, out)
    fp32; counters (row-groups,) int32; n_out; nq (quads); nch (chunks a row); cps (chunks a
    K-slice); qpb (quads a block); cbexp (:func:`codebook_exponent`); g32 (the norm weight's int32
    view), res, eps: the fused operands (unread without them).
    """
    key = (warps, QW, D2, pre, post)
    if key in _stream_cache:
        return _stream_cache[key]
    check_stream_shape(warps, D2)
    check_ops(pre, post)
    WSQ = (warps, 1) if pre == "rms" else (1, 1)  # shared: the warps' shares of the row's sum of squares
    nt = warps * 32
    KT = 64 // warps  # k-tiles (8 entries of one codebook) a warp builds every chunk
    SLOT = QW * STREAM_ROWS  # code words a lane holds a chunk
    RING = D2 * SLOT
    build, start, ids, lookup, finish = _stream_parts(warps, 2, pre, post)
    zero = int32(0)

    # Each kernel keeps its own fetch: the same load-or-zero as a shared device function changed
    # ptxas's register allocation here (103 -> 106 at 16 warps, a 4-byte spill at 8 warps, 3 slots).
    _, release = launch_hooks()

    @cuda.jit(device=True, **INLINE)
    def fetch(ring, o, codes, c, c1, qb0, qn, nq, warp, lane):
        for i in range(QW):
            ql = warp + i * warps
            if c < c1 and ql < qn:
                # read once: past L1 (session 38: -5 % at 4096 x 14336, -20 % at 16384 x 53248 against ld.global)
                ring[o + 4 * i], ring[o + 4 * i + 1], ring[o + 4 * i + 2], ring[o + 4 * i + 3] = load16_stream(
                    codes, ((uint32(c) * uint32(nq) + uint32(qb0 + ql)) * uint32(32) + lane) * uint32(4))
            else:
                ring[o + 4 * i], ring[o + 4 * i + 1], ring[o + 4 * i + 2], ring[o + 4 * i + 3] = zero, zero, zero, zero

    @cuda.jit(device=True, **INLINE)
    def look(sm, ring, o, acc, tb, lane, qn, warp, up):
        l0 = (lane << uint32(2)) | tb  # byte offset: codebook 0, low half (group s), table tb
        for i in range(QW):
            if warp + i * warps < qn:  # warp-uniform
                for r in range(STREAM_ROWS):
                    acc[4 * i + r] = cuda.fma(lookup(sm, uint32(ring[o + 4 * i + r]), l0), up, acc[4 * i + r])

    @cuda.jit(device=True, **INLINE)
    def step(sm, ring, slot, bfr, acc, codes, c0, c1, lc, nc, qb0, qn, nq, warp, lane, cbexp, up):
        # Returns chunk lc + 1's factor (build's).
        fetch(ring, ((slot + D2 - 1) % D2) * SLOT, codes, c0 + lc + D2 - 1, c1, qb0, qn, nq, warp, lane)
        up_next = float32(1.0)
        if lc + 1 < nc:
            up_next = build(sm, bfr, lc + 1, (lc + 1) & 1, warp, lane, cbexp)
        look(sm, ring, slot * SLOT, acc, uint32(lc & 1) << uint32(16), lane, qn, warp, up)
        cuda.syncthreads()
        return up_next

    # launch_bounds: one block an SM (its tables take most of the shared memory); without them ptxas
    # gave 16-warp blocks of 4 quads a warp 137 registers, which 512 threads cannot launch with.
    with_res = residual_add(post)  # where one K-slice writes y

    @cuda.jit(**({} if SIM else {"launch_bounds": (nt,)}))
    def kernel(x32, codes, cb32, scales, bias, y, ws, counters, n_out, nq, nch, cps, qpb, cbexp, g32, res, eps):
        sm = cuda.shared.array(0, int32)
        last = cuda.shared.array(1, int32)
        wsq = cuda.shared.array(WSQ, float32)
        tid, warp, lane, qb0 = ids(qpb)
        qn = min(qpb, nq - qb0)  # quads of this block
        split = cuda.blockIdx.y
        nsplit = cuda.gridDim.y
        c0 = int32(split * cps)
        c1 = int32(min(c0 + cps, nch))
        nc = c1 - c0

        # 1-2. the first chunks' codes; x's K-slice to shared memory (fused: through registers,
        #      normalised or gated on the way); B fragments; chunk 0's table
        ring = cuda.local.array(RING, int32)
        for s in range(D2 - 1):
            fetch(ring, s * SLOT, codes, c0 + s, c1, qb0, qn, nq, warp, lane)
        bfr = cuda.local.array(KT, int32)
        up = start(sm, x32, g32, cb32, uint32(0), bfr, wsq, c0, nc, tid, warp, lane, cbexp, eps)

        # 3. the chunks, the loop body written out D2 times so every code slot index is a constant
        acc = cuda.local.array(SLOT, float32)
        for i in range(SLOT):
            acc[i] = float32(0.0)
        lc = int32(0)
        while lc < nc:
            up = step(sm, ring, 0, bfr, acc, codes, c0, c1, lc, nc, qb0, qn, nq, warp, lane, cbexp, up)
            lc += 1
            if lc < nc:
                up = step(sm, ring, 1, bfr, acc, codes, c0, c1, lc, nc, qb0, qn, nq, warp, lane, cbexp, up)
                lc += 1
            if D2 == 3 and lc < nc:
                up = step(sm, ring, 2, bfr, acc, codes, c0, c1, lc, nc, qb0, qn, nq, warp, lane, cbexp, up)
                lc += 1

        release()  # the next launch may start placing its blocks: this one's are into their last stage
        # 4. rows: the 32 lanes' partials, scaled
        for i in range(QW):
            ql = warp + i * warps
            if ql < qn:  # warp-uniform
                for r in range(STREAM_ROWS):
                    v = warp_sum_f32(acc[4 * i + r])
                    row = (qb0 + ql) * STREAM_ROWS + r
                    if lane == uint32(r) and row < n_out:
                        v *= float32(scales[row])
                        if nsplit == 1:
                            y[0, row] = with_res(v + float32(bias[row]), res, 0, row)
                        else:
                            ws[split, 0, row] = v
        if nsplit > 1 and last_to_finish(counters, cuda.blockIdx.x, nsplit, last, tid):
            finish(y, ws, bias, res, nsplit, qb0, qn * STREAM_ROWS, n_out, tid, float32(1.0))

    _stream_cache[key] = kernel
    return kernel


# -- the chunk kernel (M = 2, batch 1): one chunk a block, its rows streamed -----------------
# Why: the streaming kernel's rows stay in registers over a K-slice, so a block owns only ~100 rows
# at 4096 x 14336 and builds every chunk's 64 KiB table for those few (its table stores outnumber its
# lookups), and it meets at a barrier every chunk (NOTES, session 38). Here a block builds one chunk's
# table once and streams as many rows through it as the plan gives it (hundreds to thousands), a warp
# a tile of 16 or 32 rows at a time, the next tile's codes in flight while it looks up this one, no
# barrier after the build. A tile's 32 lanes (one a group pair) meet by a halving exchange that leaves
# lane l with row l (or l / 2) of the tile: one shuffle a row. Chunks of a row meet as K-slices do.
_chunk_cache: dict = {}


def _halver(n: int, o: int):
    """One step of a warp's halving exchange: ``acc[0:n]`` -> ``acc[0:n/2]``, each lane keeping the
    half its lane bit ``o`` picks and adding its partner's (lane ^ o) copy of that half."""
    h = n // 2

    @cuda.jit(device=True, **INLINE)
    def halve(acc, lane):
        upper = (lane & uint32(o)) != uint32(0)
        for i in range(h):
            lo, hi = acc[i], acc[i + h]  # both loaded, then selected: a select of addresses would keep acc in local memory
            keep = hi if upper else lo
            send = lo if upper else hi
            acc[i] = keep + warp_xor_f32(send, o)

    return halve


def chunk_finish_rows(qpb: int, warps: int) -> int:
    """Adjacent rows a thread of the chunk kernel's finishing block sums (1, 2 or 4): as many as a
    block's rows leave each of its threads, so every thread has loads in flight and they are wide."""
    per = qpb * STREAM_ROWS // (32 * warps)
    return 4 if per >= 4 else 2 if per >= 2 else 1


def chunk_ws_columns(n_out: int, pre: str) -> int:
    """Columns of the chunk kernel's K-slice workspace: the layer's rows padded to quads (so a
    finishing thread's 2 or 4 rows are one aligned load), and with pre='rms' a quad more, whose last
    column holds each K-slice's sum of squares of x."""
    return (stream_quads(n_out) + (pre == "rms")) * STREAM_ROWS


def chunk_kernel(warps: int, QT: int, pre: str = "", post: str = "", cs: int = 0, fw: int = 1, halves: int = 1):
    """The chunk kernel (M = 2, batch 1; see the comment above; ``halves=2``: M = 4 as two M = 2 layers
    over the same x and scales, codebooks 0-1 and 2-3, whose chunks the grid's second half takes;
    :func:`stream_codes`): grid (row-groups, chunks), a block of ``warps`` warps builds its chunk's table (as :func:`stream_kernel`'s step 2, from x staged with
    ``pre``) and its warps walk the row-group's quads ``QT`` at a time: 16-byte code loads a lane
    (``ld.global.nc``; the next tile's issued before this tile's lookups), four lookups a row and
    lane, then the halving exchange. Each row's chunk sum, times the table's factor and the row's
    scale, goes to the workspace (one chunk: to y, with bias and ``post``); the last block of a
    row-group sums the chunks (as :func:`additive_kernel`). pre='rms': every block stages its chunk of
    g * x un-normalised and sums that chunk's squares; the chunks' sums meet where the row-group's chunks
    do, and 1 / rms multiplies the row's sum where y is written. ``cs`` > 1: the grid's ``cs`` chunks of a
    row-group are one thread block cluster instead, each block keeps its rows' chunk sums in shared
    memory (a static array, :data:`CLUSTER_ROWS` long) and, after a cluster barrier, sums 1 / cs of the
    row-group's rows over the cluster's blocks through distributed shared memory and writes them: no
    workspace, counter or second pass through L2 (GPU only). Otherwise each thread of the finishing
    block sums ``fw`` adjacent rows (:func:`chunk_finish_rows`, :func:`~trapetum.gemv.rows_summer`). Arguments as
    :func:`stream_kernel`'s (``cps`` is 1 and unread; ``qpb`` a multiple of ``QT``)."""
    fw = 1 if cs > 1 else fw
    key = (warps, QT, pre, post, cs, fw, halves)
    if key in _chunk_cache:
        return _chunk_cache[key]
    check_chunk_shape(warps, QT)
    if halves not in (1, 2):
        raise ValueError(f"the chunk kernel runs M=2 (halves=1) or M=4 (halves=2) codes, got halves={halves}")
    check_ops(pre, post)
    if cs > 1 and SIM:
        raise ValueError("the chunk kernel's cluster finish runs on a GPU only (the CUDA simulator runs one block at a time)")
    if cs > MAX_CLUSTER:
        raise ValueError(f"the chunk kernel's cluster finish takes at most {MAX_CLUSTER} chunks, got {cs}")
    WSQ = (warps, 2) if pre == "rms" else (1, 1)  # [w, 0]: a warp's sum of squares; [w, 1]: its largest |g x| (start)
    SO = STREAM_TABLE_WORDS + STREAM_X_WORDS  # word offset of the chunk's sum of squares (cs > 1, pre='rms')
    CBO = 2 * K * D // 2  # words of two codebooks: halves=2's second half's B fragments start there
    # A cluster block's rows' chunk sums are a static array: where they sat in the dynamic shared memory
    # past x, the tile's store to them kept ptxas from folding the table's shared base into the lookups
    # (an IMAD a lookup in every 7B cluster build), and the restage pass took the rms builds to 201
    # registers. Static, every cluster build has LDS [R+UR] with the pass (ptxas, sm_90; NOTES "Session 57").
    RSUM = CLUSTER_ROWS if cs > 1 else 1
    nt = warps * 32
    KT = 64 // warps
    ROWS = QT * STREAM_ROWS  # rows a tile: code words a lane holds for one
    RING = 2 * ROWS  # two tiles' code words: the next one loads while this one is looked up
    SHIFT = 6 - ROWS.bit_length()  # the tile row lane l ends the exchange with: l >> SHIFT
    OWNER = (1 << SHIFT) - 1  # lanes l & OWNER == 0 write it
    # The row's sum of squares is its chunks': no block reads the whole row before its build (that cost
    # the global finish's plans ~2 us a call at 7B and 3-7 us at 70B's 8192 inputs). With a cluster the
    # chunks' sums meet in distributed shared memory; otherwise in the workspace's last column
    # (chunk_ws_columns), as the table kernel's K-slices' do, and the finishing block applies 1 / rms.
    _, start, ids, lookup, finish_row = _stream_parts(warps, 1, pre, post, defer_rms=True)
    RMS = pre == "rms"
    h16, h8, h4, h2, h1 = (_halver(ROWS >> k, 16 >> k) for k in range(5))
    _, release = launch_hooks()
    with_res = residual_add(post)  # where a layer of one chunk writes y
    zero = int32(0)

    HQ = QT // 2  # quads a half tile

    @cuda.jit(device=True, **INLINE)
    def fetch(ring, o, codes, c, q0, qend, nq, lane, h):
        # Half h of the tile: quads h HQ .. h HQ + HQ - 1. Quad q0 + i's words are word w0 + 128 i: a
        # 64-bit base and constant steps, so every load is [R + imm] off one address (ptxas, sm_90: the
        # 70B gate_up build's tile loop lost ~80 address and predicate instructions a slot, where each
        # load computed its own 32-bit index, 64-bit compare and pointer). The tile loop issues a half
        # before each half of the lookups: fetched whole, ptxas put all of them in one burst before the
        # 128 lookups, and the 7B qkv and down builds lost 4-6 % (NOTES "Session 59"). The last tile of a
        # row-group, past qend, zeroes the rest.
        w0 = int64(((uint32(c) * uint32(nq) + uint32(q0)) * uint32(32) + lane) * uint32(4))
        left = int32(qend - q0)
        if left >= QT:
            for j in range(HQ):
                i = h * HQ + j
                ring[o + 4 * i], ring[o + 4 * i + 1], ring[o + 4 * i + 2], ring[o + 4 * i + 3] = load16_stream(
                    codes, w0 + int64(128 * i))
            return
        for j in range(HQ):
            i = h * HQ + j
            if int32(i) < left:
                ring[o + 4 * i], ring[o + 4 * i + 1], ring[o + 4 * i + 2], ring[o + 4 * i + 3] = load16_stream(
                    codes, w0 + int64(128 * i))
            else:
                ring[o + 4 * i], ring[o + 4 * i + 1], ring[o + 4 * i + 2], ring[o + 4 * i + 3] = zero, zero, zero, zero

    @cuda.jit(device=True, **INLINE)
    def look(sm, ring, o, acc, lane, h):
        l0 = lane << uint32(2)  # the one table's byte offset: codebook 0, group s
        for j in range(ROWS // 2):
            i = h * (ROWS // 2) + j
            acc[i] = lookup(sm, uint32(ring[o + i]), l0)

    @cuda.jit(device=True, **INLINE)
    def tile(acc, lane, q0, c, nsplit, up, rend, scales, bias, y, ws, res, r0, rsum):
        # the looked-up tile's rows summed across the lanes, and each row's sum stored
        h16(acc, lane)
        h8(acc, lane)
        h4(acc, lane)
        h2(acc, lane)
        if ROWS == 32:
            h1(acc, lane)
        else:
            acc[0] += warp_xor_f32(acc[0], 1)
        row = q0 * STREAM_ROWS + int32(lane >> uint32(SHIFT))
        if lane & uint32(OWNER) == uint32(0) and row < rend:
            v = acc[0] * up * float32(scales[row])
            if cs > 1:
                rsum[row - r0] = v
            elif nsplit == 1:
                y[0, row] = with_res(v + float32(bias[row]), res, 0, row)
            else:
                ws[c, 0, row] = v

    @cuda.jit(device=True, **INLINE)
    def finish_rows(y, ws, bias, res, nsplit, r0, nrows, tid, lane, n_in, eps):
        # a row a thread: the streaming kernel's finish (this form keeps ptxas's [R+UR] lookups at 8 warps,
        # tiles of 16; rows are checked against y.shape[1], which holds nothing live past the tile loop)
        irms = slices_irms(ws, nsplit, 0, n_in, eps) if RMS else float32(1.0)
        finish_row(y, ws, bias, res, nsplit, r0 // STREAM_ROWS, nrows, y.shape[1], tid, irms)

    if fw > 1:
        sum_rows = rows_summer(fw)

        @cuda.jit(device=True, **INLINE)
        def put(y, v, bias, res, irms, row):
            for f in range(fw):
                if row + f < y.shape[1]:  # its row-group's rows: row + f < r0 + nrows
                    y[0, row + f] = with_res(v[f] * irms + float32(bias[row + f]), res, 0, row + f)

        @cuda.jit(device=True, **INLINE)
        def finish_wide(y, ws, bias, res, nsplit, r0, nrows, tid, lane, n_in, eps):
            # The K-slices' sums of squares load with the first rows' partials, not a round trip before them
            # (nothing reads a lane's first one until the partials are in); every thread takes that first
            # step (clamped to the last rows), so the warp's sum sees all lanes.
            sq = float32(0.0)
            if RMS:
                sq = load_cg(ws, min(lane, nsplit - 1), 0, ws.shape[2] - 1)
            v = cuda.local.array(fw, float32)
            i = fw * tid
            sum_rows(ws, nsplit, 0, r0 + min(i, nrows - fw), v)
            irms = float32(1.0)
            if RMS:
                if lane >= nsplit:
                    sq = float32(0.0)
                for sp in range(lane + 32, nsplit, 32):  # past 32 K-slices: 16384 inputs and more
                    sq += load_cg(ws, sp, 0, ws.shape[2] - 1)
                irms = inv_rms(warp_sum_f32(sq), n_in, eps)
            if i < nrows:
                put(y, v, bias, res, irms, r0 + i)
            for i in range(fw * (tid + nt), nrows, fw * nt):
                sum_rows(ws, nsplit, 0, r0 + i, v)
                put(y, v, bias, res, irms, r0 + i)

    finish = finish_wide if fw > 1 else finish_rows

    # 16 warps: two blocks an SM (at most 64 registers), as ptxas chose itself until d7d80cb's restage pass
    # took rms to 88 and one block: 70B qkv 19.4 -> 22.1 us (NOTES "Session 56")
    bounds = ClusterBounds((nt,), (1, cs, 1)) if cs > 1 else ((nt, 2) if warps == 16 else (nt,))

    @cuda.jit(**({} if SIM else {"launch_bounds": bounds}))
    def kernel(x32, codes, cb32, scales, bias, y, ws, counters, n_out, nq, nch, cps, qpb, cbexp, g32, res, eps):
        sm = cuda.shared.array(0, int32)
        smf = cuda.shared.array(0, float32)  # the same dynamic shared memory, as fp32 (the chunk sums)
        last = cuda.shared.array(1, int32)
        wsq = cuda.shared.array(WSQ, float32)
        rsum = cuda.shared.array(RSUM, float32)  # cs > 1: the block's rows' chunk sums, read across the cluster
        tid, warp, lane, qb0 = ids(qpb)
        qend = min(qb0 + qpb, nq)
        r0 = qb0 * STREAM_ROWS
        c = cuda.blockIdx.y
        nsplit = cuda.gridDim.y
        step = warps * QT
        q = qb0 + warp * QT
        rend = min(n_out, qend * STREAM_ROWS)  # rows past it are the next block's, or padding

        # 1. the first tile's codes in flight; x's chunk (fused: normalised or gated); B fragments
        ring = cuda.local.array(RING, int32)
        fetch(ring, 0, codes, c, q, qend, nq, lane, 0)
        fetch(ring, 0, codes, c, q, qend, nq, lane, 1)
        bfr = cuda.local.array(KT, int32)
        # 2. the chunk's table (fp16, scaled by 2**-s; sums by up = 2**s)
        second = halves == 2 and c >= nsplit // 2  # M=4: codebooks 2-3 over x's chunk c - nsplit / 2
        cx, cbo = c, uint32(0)
        if second:
            cx, cbo = c - nsplit // 2, uint32(CBO)
        up = start(sm, x32, g32, cb32, cbo, bfr, wsq, cx, 1, tid, warp, lane, cbexp, eps)
        if RMS:  # the chunk's sum of squares (wsq: the warps' shares, before start's barriers)
            t = float32(0.0)
            for w in range(warps):
                t += wsq[w, 0]
            if second:  # each input's square counted once
                t = float32(0.0)
            if cs > 1:
                if tid == 0:  # for the cluster's blocks, after its barrier (the tiles write past it)
                    smf[SO] = t
            elif nsplit == 1:  # the whole row: the tiles write y
                up *= inv_rms(t, x32.shape[1] * 2, eps)
            elif tid == 0:  # the same value from every row-group's block of this chunk
                ws[c, 0, ws.shape[2] - 1] = t

        # 3. the row tiles, two code slots written out so their indices are constants
        acc = cuda.local.array(ROWS, float32)
        while q < qend:
            for h in range(2):
                fetch(ring, ROWS, codes, c, q + step, qend, nq, lane, h)
                look(sm, ring, 0, acc, lane, h)
            tile(acc, lane, q, c, nsplit, up, rend, scales, bias, y, ws, res, r0, rsum)
            q += step
            if q >= qend:
                break
            for h in range(2):
                fetch(ring, 0, codes, c, q + step, qend, nq, lane, h)
                look(sm, ring, ROWS, acc, lane, h)
            tile(acc, lane, q, c, nsplit, up, rend, scales, bias, y, ws, res, r0, rsum)
            q += step

        release()  # the next launch may start placing its blocks: this one's are into their last stage
        # 4. the row-group's chunks: summed across the cluster (block c takes the c-th share of the
        #    rows; the second barrier keeps every block's sums in place until all are read), or by
        #    the last block to finish
        if cs > 1:
            cluster_sync()
            irms = float32(1.0)
            if RMS:
                t = float32(0.0)
                for k in range(cs):
                    t += load_cluster_f32(smf, SO, k)
                irms = inv_rms(t, x32.shape[1] * 2, eps)
            per = (rend - r0 + cs - 1) // cs
            for i in range(c * per + tid, min(rend - r0, (c + 1) * per), nt):
                v = float32(0.0)
                for k in range(cs):
                    v += load_cluster_f32(rsum, i, k)
                y[0, r0 + i] = with_res(v * irms + float32(bias[r0 + i]), res, 0, r0 + i)
            cluster_sync()
        elif nsplit > 1 and last_to_finish(counters, cuda.blockIdx.x, nsplit, last, tid):
            finish(y, ws, bias, res, nsplit, r0, (qend - qb0) * STREAM_ROWS, tid, lane, x32.shape[1] * 2, eps)

    _chunk_cache[key] = kernel
    return kernel


@dataclass
class AdditivePlan:
    warps: int
    RB: int  # row-blocks (of 32 rows) a thread block
    cps: int  # 16-byte chunk columns a K-slice (groups a slice: cps * 16 / M)
    ksplit: int
    bt: int  # batch rows a block (grid z covers the batch in tiles of bt)
    shared_bytes: int  # dynamic: the table, bt * cps * 16 KiB in fp32 (plus padding under the mma build)
    build: str = "fma"  # the table: "fma" (scalar multiply-adds) or "mma" (tensor cores)
    table: str = "fp32"  # its entries: "fp32" or "fp16" (mma build only; half the bytes)

    def label(self) -> str:
        """The plan in a few words (the fused step's and the bench's record of it)."""
        return f"additive: {self.warps} warps, RB {self.RB}, K-split {self.ksplit}, {self.table} table"


def plan_additive(n_out: int, nchunks: int, M: int, B: int, sms: int, smem: int, warps: int | None = None, RB: int | None = None,
                  cps: int | None = None, ksplit: int | None = None, bt: int | None = None, build: str = "fma",
                  table: str = "fp32") -> AdditivePlan:
    """Launch plan for one layer. Without overrides: blocks of up to 16 row-blocks (512 rows, so the
    table is amortized over many rows), bt = the batch where it fits, and K-slices sized so about
    two blocks share an SM. ``smem`` is what a block may opt in to (227 KiB on an H100)."""
    check_table(table, build == "mma")
    chunk_lut = CHUNK_BYTES * K * TABLES[table]  # table bytes of one chunk column and batch row
    rbs = -(-n_out // ROW_BLOCK)
    usable = smem - 64  # static shared memory: the 'last' flag
    budget = smem // 2 if smem > 2 * SMEM_OPTIN_FLOOR else usable  # two blocks an SM where the GPU allows
    if bt is None:
        bt = max(1, min(B, budget // chunk_lut, usable // chunk_lut))
    if not 1 <= bt <= B:
        raise ValueError(f"bt={bt}: batch rows a block must be in 1..{B}")
    if ksplit is not None:
        cps = -(-nchunks // ksplit)
    elif cps is None:
        cps = max(1, min(nchunks, MAX_CPS, budget // (bt * chunk_lut)))
    cps = max(1, min(cps, nchunks))
    if cps > MAX_CPS:
        raise ValueError(f"cps={cps} chunk columns a K-slice: at most {MAX_CPS} (a lane holds two row-blocks' chunks in "
                         f"registers; more spill to local memory); use ksplit >= {-(-nchunks // MAX_CPS)}")
    if bt * cps * chunk_lut > usable:
        raise ValueError(f"bt={bt} x cps={cps} chunk columns need {bt * cps * chunk_lut} bytes of table; "
                         f"a block may use {usable} (more K-slices or a smaller batch tile)")
    ksplit = -(-nchunks // cps)
    cps = -(-nchunks // ksplit)  # even slices
    RB = max(1, min(RB or 16, rbs))
    warps = warps or max(1, min(8, RB))
    if build not in ("fma", "mma"):
        raise ValueError(f"build must be 'fma' or 'mma', got {build!r}")
    nbytes = lut_bytes(M, bt, cps, build == "mma", table)
    if nbytes > usable:
        raise ValueError(f"bt={bt} x cps={cps} chunk columns need {nbytes} bytes of table; a block may use {usable}")
    return AdditivePlan(warps, RB, cps, ksplit, bt, nbytes, build, table)



def candidate_plans(n_out: int, nchunks: int, M: int, B: int, sms: int, smem: int) -> list[AdditivePlan]:
    """Plans the tuner times: row-blocks a block x table sizes (a quarter to all of the opt-in
    shared memory) x batch tiles; each compiles its own kernel, so the list is kept short."""
    rbs = -(-n_out // ROW_BLOCK)
    per = max(1, (smem - 64) // CHUNK_LUT_BYTES)  # chunk columns x batch rows that fit at all
    bts = sorted({min(B, b) for b in (3, 6, per)})  # a batch tile of 1 at B > 1 rebuilds the table B times
    out, seen = [], set()
    for RB in (8, 16, 32):
        for bt in bts:
            if bt > per:
                continue
            for share in (4, 3, 2, 1):
                c = max(1, min(MAX_CPS, per // share // bt))
                try:
                    p = plan_additive(n_out, nchunks, M, B, sms, smem, RB=RB, cps=c, bt=bt)
                except ValueError:
                    continue
                key = (p.RB, p.cps, p.bt, p.warps)
                blocks = -(-rbs // p.RB) * p.ksplit * -(-B // p.bt)
                if key not in seen and blocks >= min(sms, rbs):
                    seen.add(key)
                    # the tensor-core build of every plan, with fp32 and fp16 tables of the same
                    # slice (the fp16 one in half the bytes: more blocks an SM); the scalar build of
                    # the heuristic plan only, so each run still measures both (the padding's 16 bytes
                    # a column may not fit)
                    try:
                        out.append(plan_additive(n_out, nchunks, M, B, sms, smem, RB=RB, cps=c, bt=bt, build="mma"))
                    except ValueError:
                        out.append(p)
                    out.append(plan_additive(n_out, nchunks, M, B, sms, smem, RB=RB, cps=c, bt=bt, build="mma", table="fp16"))
    h = plan_additive(n_out, nchunks, M, B, sms, smem)
    if (h.RB, h.cps, h.bt, h.warps, h.build, h.table) not in {(p.RB, p.cps, p.bt, p.warps, p.build, p.table) for p in out}:
        out.append(h)
    return out


@dataclass
class StreamPlan:
    """A launch of :func:`stream_kernel`: ``warps`` a block, ``ksplit`` K-slices, ``slots`` code
    slots a warp; ``qpb`` quads of rows a block (up to ``QW`` a warp), ``cps`` of the layer's ``nch``
    64-group chunks a K-slice."""
    warps: int
    ksplit: int
    slots: int
    qpb: int
    QW: int
    cps: int
    nch: int
    shared_bytes: int
    kernel: str = "stream"  # or "chunk": :func:`chunk_kernel` (the same code layout)
    build: str = "stream"  # (in an AdditivePlan, the table build)
    tile: int = 0  # the chunk kernel's quads a warp tile
    cluster: int = 0  # the chunk kernel's blocks a cluster (its chunks meet in distributed shared memory); 0: a global finish

    def label(self) -> str:
        if self.kernel == "chunk":
            return (f"additive chunk: {self.warps} warps, a chunk a block, {self.qpb * STREAM_ROWS} rows a block "
                    f"in tiles of {self.tile * STREAM_ROWS}" + (f", clusters of {self.cluster}" if self.cluster else ""))
        return f"additive stream: {self.warps} warps, K-split {self.ksplit}, {self.slots} code slots"

    def grid(self, n_out: int) -> tuple[int, int]:
        return -(-stream_quads(n_out) // self.qpb), self.ksplit


def stream_registers_fit(warps: int, QW: int, slots: int) -> bool:
    """Whether a warp's code slots and sums stay in registers: (slots + 1) x 4 x QW words beside ~44 others,
    within what ``warps`` warps a block leave a thread (65536 / threads; ptxas spilled at QW 16 with 8 warps
    below its 255 cap, so 232). Counted with ptxas on the CPU at 8, 16 and 32 warps (session 38)."""
    return (slots + 1) * 4 * QW + 44 <= min(232, 65536 // (32 * warps))


def plan_stream(n_out: int, n_in: int, sms: int, smem: int, warps: int = 8, ksplit: int = 1, slots: int = 2,
                blocks: int | None = None) -> StreamPlan:
    """The streaming kernel's plan for an (out, in) M=2 layer: about ``blocks`` (default: one an SM)
    blocks, ``ksplit`` K-slices of them. Raises ValueError where it cannot run (its two 64 KiB tables
    need an opt-in block of ~130 KiB or more: sm_80, sm_90)."""
    check_stream_shape(warps, slots)
    nq, nch = stream_quads(n_out), stream_chunks(n_in // D)
    if not 1 <= ksplit <= nch:
        raise ValueError(f"ksplit={ksplit}: an {n_in}-input layer has {nch} chunks of {STREAM_GROUPS * D} inputs")
    cps, ksplit = stream_slices(nch, ksplit)
    rgs = max(1, min(nq, (blocks or sms) // ksplit))
    qpb = -(-nq // rgs)
    QW = -(-qpb // warps)
    if not stream_registers_fit(warps, QW, slots):
        raise ValueError(f"{qpb} quads of rows a block is {QW} a warp: with {slots} code slots its registers would spill "
                         f"at {warps} warps a block (fewer warps, more blocks or K-slices)")
    nbytes = stream_shared_bytes(nch, ksplit)
    if nbytes + 64 > smem:
        raise ValueError(f"the streaming kernel needs {nbytes} bytes of shared memory a block; this GPU allows {smem}")
    return StreamPlan(warps, ksplit, slots, qpb, QW, cps, nch, nbytes)


CLUSTER_ROWS = 1024  # the most rows a cluster plan's block takes: its rows' chunk sums are a static array this long


def chunk_shared_bytes(cluster: bool = False) -> int:
    """Shared memory of a chunk-kernel block: one chunk table and its slice of x (dynamic), and with a
    cluster finish the chunk's sum of squares (dynamic) and :data:`CLUSTER_ROWS` rows' chunk sums (static)."""
    return 4 * (STREAM_TABLE_WORDS + STREAM_X_WORDS + (1 + CLUSTER_ROWS if cluster else 0))


def plan_chunk(n_out: int, n_in: int, smem: int, warps: int = 8, tile: int = 4, rows: int = 512,
               cluster: bool = False, M: int = 2) -> StreamPlan:
    """The chunk kernel's plan for an (out, in) M=2 layer: grid (row-groups, chunks), a block of
    ``warps`` warps over about ``rows`` rows (rounded to whole rounds of its warps' tiles of ``tile``
    quads); ``cluster``: a row-group's chunks one thread block cluster (2 to MAX_CLUSTER chunks; the kernel
    runs it on a GPU only). M=4: twice the chunks (two M=2 layers, :func:`chunk_kernel`'s ``halves``).
    Raises ValueError where it cannot run."""
    check_chunk_shape(warps, tile)
    if rows < 1:
        raise ValueError(f"chunk plan: rows a block must be positive, got {rows}")
    if M not in (2, 4):
        raise ValueError(f"chunk plan: the chunk kernel runs M=2 or M=4 codes, got M={M}")
    nq, nch = stream_quads(n_out), stream_chunks(n_in // D) * (M // 2)
    per = warps * tile  # quads a block's warps take in one round
    qpb = min(per * max(1, round(rows / (per * STREAM_ROWS))), -(-nq // per) * per)
    if cluster and not 1 < nch <= MAX_CLUSTER:
        raise ValueError(f"chunk plan: a cluster finish takes 2 to {MAX_CLUSTER} chunks of {STREAM_GROUPS * D} inputs; "
                         f"in_features={n_in} makes {nch}" + (" at M=4 (two halves)" if M == 4 else ""))
    if cluster and qpb * STREAM_ROWS > CLUSTER_ROWS:
        raise ValueError(f"chunk plan: a cluster finish takes at most {CLUSTER_ROWS} rows a block, "
                         f"{rows} asked make {qpb * STREAM_ROWS}")
    total = chunk_shared_bytes(cluster)
    if total + 64 > smem:
        raise ValueError(f"the chunk kernel needs {total} bytes of shared memory a block; this GPU allows {smem}")
    nbytes = total - (4 * CLUSTER_ROWS if cluster else 0)  # what the launch asks for: the dynamic part
    return StreamPlan(warps, nch, 2, qpb, 0, 1, nch, nbytes, kernel="chunk", tile=tile, cluster=nch if cluster else 0)


# (warps, tile, rows). 2048 and 4096 rows: fewer blocks build each chunk's table (every block builds its
# own): 70B gate_up with rms 52.3 us at 1024 rows, 49.8 at 2048, 48.0 at 4096; 70B down 31.1 -> 30.1 at
# 2048; qkv and o slower (data/_runs/rows-probe-4d4d86f-h200.json)
CHUNK_PLANS = ((8, 4, 256), (8, 4, 512), (8, 4, 1024), (8, 8, 512), (8, 8, 1024), (8, 8, 2048), (8, 8, 4096), (16, 4, 512),
               (16, 4, 1024))


def chunk_candidates(n_out: int, n_in: int, smem: int, clusters: bool = True, M: int = 2,
                     max_cluster: int = MAX_CLUSTER) -> list[StreamPlan]:
    """The chunk kernel's plans the tuner times for an M=2 (or M=4) layer at batch 1 (distinct ones
    only), each also with a cluster finish where the layer has 2 to ``max_cluster`` chunks and ``clusters``
    (a GPU of compute capability 9.0 or later)."""
    out = []
    for w, qt, rows in CHUNK_PLANS:
        for cluster in (False, True) if clusters else (False,):
            try:
                p = plan_chunk(n_out, n_in, smem, warps=w, tile=qt, rows=rows, cluster=cluster, M=M)
            except ValueError:
                continue
            if p not in out and p.cluster <= max_cluster:
                out.append(p)
    return out


STREAM_WARPS = 16
STREAM_KSPLITS = (1, 2, 4, 6)  # the K-splits the tuner tries (session 38's probes: every fastest plan was one of them)


def stream_candidates(n_out: int, n_in: int, sms: int, smem: int) -> list[StreamPlan]:
    """The streaming plans the tuner times for an M=2 layer at batch 1 (none where they do not fit)."""
    out = []
    for ks in STREAM_KSPLITS:
        try:
            p = plan_stream(n_out, n_in, sms, smem, warps=STREAM_WARPS, ksplit=ks)
        except ValueError:
            continue
        if all(q.ksplit != p.ksplit for q in out):
            out.append(p)
    return out


def stream_rms_fits(plan: StreamPlan, smem: int) -> bool:
    """Whether a streaming plan's block leaves room in ``smem`` for pre='rms' sums of squares (a word a warp and one)."""
    return plan.shared_bytes + 4 * (1 + plan.warps) <= smem


_TUNED = PlanCache("additive", AdditivePlan, StreamPlan)
_LIMITED: dict = {}


def _with_limit(kern, args, plan):
    """gemv.with_shared_limit, once per kernel, table size and device (it specializes and compiles)."""
    nbytes, cluster = plan.shared_bytes, getattr(plan, "cluster", 0)
    key = (id(kern), nbytes, None if SIM else torch.cuda.current_device())
    if key not in _LIMITED:
        _LIMITED[key] = with_shared_limit(kern, args, nbytes, cluster)
    return _LIMITED[key]


class AdditiveGemv:
    """An additive-codebook weight prepared for the fused kernel on one device: ``y = gemv(x)``.

    Holds the codes only in the kernels' layouts (:attr:`t` rebuilds the natural tensor).
    ``plan``: optional overrides for :func:`plan_additive` (keys warps, RB, cps, ksplit, bt, build, table),
    ``{"kernel": "stream", ...}`` for :func:`plan_stream` (warps, ksplit, slots) or ``{"kernel": "chunk", ...}``
    for :func:`plan_chunk` (warps, tile, rows); otherwise tuned on a
    GPU (``tune=True``) or taken from the heuristic. ``kernels``: the families the tuner may pick from:
    "table" (:func:`additive_kernel`, every batch and the fused operations) and "stream"
    (:func:`stream_kernel` and :func:`chunk_kernel`, which read the same layout: M=2 at batch 1, the chunk kernel M=4 too, with
    or without the fused operations; a layer that uses both families holds its codes twice). ``single_layout``: the batch-1 plain plan picks the family every call
    of this weight then uses, so it holds one copy of its codes (a model's layers,
    :class:`trapetum.qlinear.AdditiveQLinear`): its fused plans are tuned within that family, and
    where it is the streaming kernel a batch of 2 to 16 runs it a row at a time (B reads of the
    2-bit codes: less traffic than rebuilding the fp16 weight for cuBLAS at every such batch).
    """

    max_batch = MAX_FUSED_BATCH  # larger batches: QLinear's dequantize + cuBLAS
    FAMILIES = ("table", "stream")

    def __init__(self, t: AdditiveTensor, device=None, plan: dict | None = None, tune: bool = True,
                 kernels: tuple[str, ...] = FAMILIES, single_layout: bool = False):
        self.device = kernel_device(device, "AdditiveGemv")
        if not isinstance(t, AdditiveTensor):
            raise TypeError(f"AdditiveGemv takes an AdditiveTensor, got {type(t).__name__}")
        t.validate()
        if "table" not in kernels or set(kernels) - set(self.FAMILIES):
            raise ValueError(f"kernels must be 'table' and optionally 'stream' (the table kernel serves every batch), got {kernels}")
        if plan is not None and plan.get("kernel") in ("stream", "chunk") and "stream" not in kernels:
            raise ValueError("a streaming plan was asked for with kernels that leave the streaming kernel out")
        self.kernels, self.single_layout = tuple(kernels), bool(single_layout)
        t = t.to(self.device)
        self.M, self.n_in, self.n_out = t.M, t.in_features, t.out_features
        self.fixed_plan = plan
        self.tune_on_gpu = tune and not SIM and tuning_enabled("additive")
        self.weight_bytes = t.nbytes
        self._ncode_bytes = t.codes.shape[1] * t.M
        self.nchunks = self._ncode_bytes // CHUNK_BYTES
        self.rbs = -(-self.n_out // ROW_BLOCK)
        # Own copies: the kernel reads the codebooks 16 bytes at a time, so they must start 16-byte aligned.
        self._codebooks, self._scales = t.codebooks.clone(memory_format=torch.contiguous_format), t.scales.contiguous()
        self._bias_t = t.bias
        bias = t.bias if t.bias is not None else torch.zeros_like(t.scales)
        self._G = t.codes.shape[1]
        # The codes in the layouts the prepared plans read (see _hold): the table kernel's tiled one
        # to start with, the streaming kernel's once a stream plan is picked (the tiled one then dropped
        # unless another plan still reads it).
        self._tiled_t, self._stream_t = tile_codes(t.codes), None
        self._cb32_t = self._codebooks.reshape(-1).view(torch.int32)
        self._cbexp = codebook_exponent(self._codebooks)
        self._bias_k = bias.contiguous()
        self._tiled, self._stream = _as_kernel_array(self._tiled_t), None
        self._cb32 = _as_kernel_array(self._cb32_t)
        self._sc = _as_kernel_array(self._scales)
        self._bias = _as_kernel_array(self._bias_k)
        self._plans: dict[int, tuple] = {}
        self._fused_plans: dict[tuple, tuple] = {}

    def _natural(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """(rows, in/8, M) uint8 codes rebuilt from whichever layout is held (a copy)."""
        r0, r1 = (0, self.n_out) if rows is None else rows
        if self._tiled_t is not None:
            return untile(self._tiled_t, self.n_out, self._ncode_bytes, rows=rows).reshape(r1 - r0, self.n_in // D, self.M)
        return unstream_codes(self._stream_t, self.n_out, self._G, rows=(r0, r1), M=self.M)

    def _hold(self, layout: str) -> None:
        """Make sure the codes are held in ``layout`` ("tiled" or "stream"), and drop a layout no
        prepared plan reads: a layer keeps one copy of its codes unless it is called both ways."""
        if layout == "stream" and self._stream_t is None:
            self._stream_t = stream_codes(self._natural())
            self._stream = _as_kernel_array(self._stream_t)
        elif layout == "tiled" and self._tiled_t is None:
            self._tiled_t = tile_codes(self._natural())
            self._tiled = _as_kernel_array(self._tiled_t)
        plans = [e[1] for e in (*self._plans.values(), *self._fused_plans.values())]
        if plans and all(isinstance(p, StreamPlan) for p in plans) and layout == "stream":
            self._tiled_t = self._tiled = None
        elif plans and not any(isinstance(p, StreamPlan) for p in plans) and layout == "tiled":
            self._stream_t = self._stream = None

    @property
    def t(self) -> AdditiveTensor:
        """The weight in the natural layout (rebuilt from the kernel's codes: a copy)."""
        return AdditiveTensor(self._natural(), self._codebooks, self._scales, self._bias_t)

    @property
    def bytes_read(self) -> int:
        """Bytes a batch-1 call must move at least: codes, codebooks, scales, x and y."""
        return self.weight_bytes + 2 * (self.n_in + self.n_out)

    def check_input(self, x: torch.Tensor) -> torch.Tensor:
        return check_activation(x, self.n_in, self.device)

    def _smem(self) -> int:
        return max_shared_bytes(self.device)

    def _launch_parts(self, B: int, plan, pre: str = "", post: str = ""):
        if isinstance(plan, StreamPlan):
            if B != 1:
                raise ValueError(f"{plan.label()}: the streaming kernel runs batch 1")
            if pre == "rms" and not stream_rms_fits(plan, OPTIN_SIM if SIM else self._smem()):  # as _prepare plans it
                raise ValueError(f"{plan}: its tables leave no room for pre='rms' sums of squares ({4 * plan.warps} bytes)")
            if plan.cluster and not SIM and not clusters_available(self.device):
                raise ValueError(f"{plan.label()}: a cluster finish needs a GPU of compute capability 9.0 or later "
                                 f"(this one is {'.'.join(map(str, torch.cuda.get_device_capability(self.device)))})")
            chunk = plan.kernel == "chunk"
            if chunk and plan.cluster and plan.qpb * STREAM_ROWS > CLUSTER_ROWS:
                raise ValueError(f"{plan.label()}: a cluster finish takes at most {CLUSTER_ROWS} rows a block")
            if not chunk and self.M != 2:
                raise ValueError(f"{plan.label()}: the streaming kernel runs M=2 codes (M=4 runs the chunk kernel)")
            kern = (chunk_kernel(plan.warps, plan.tile, pre, post, plan.cluster, chunk_finish_rows(plan.qpb, plan.warps), self.M // 2)
                    if chunk else stream_kernel(plan.warps, plan.QW, plan.slots, pre, post))
            grid = plan.grid(self.n_out)
            rows, ncounters = chunk_ws_columns(self.n_out, pre) if chunk else self.n_out, grid[0]
        else:
            kern = additive_kernel(self.M, B, plan.bt, plan.warps, plan.RB, plan.cps, plan.build == "mma", plan.table, pre, post)
            groups = -(-self.rbs // plan.RB)
            grid = (groups, plan.ksplit, -(-B // plan.bt))
            rows, ncounters = table_ws_columns(self.rbs * ROW_BLOCK, pre), groups * grid[2]
        if isinstance(plan, StreamPlan) and plan.cluster:
            # a row's chunks meet in distributed shared memory: the kernel never touches these (at 7B a
            # fused step's cluster launches would otherwise hold ~40 MB of them)
            rows, ncounters, splits = 1, 1, 1
        else:
            splits = plan.ksplit
        ws = torch.empty(splits, B, rows, dtype=torch.float32, device=self.device)
        counters = torch.zeros(ncounters, dtype=torch.int32, device=self.device)
        return kern, plan, grid, (ws, counters), (_as_kernel_array(ws), _as_kernel_array(counters))

    def _family(self) -> str:
        """The family of the plain batch-1 plan ("stream" or "table"): single_layout's every call keeps to it."""
        return "stream" if isinstance(self._prepare(1)[1], StreamPlan) else "table"

    def _rows_by_one(self, B: int) -> bool:
        """Whether a batch-B call runs the batch-1 streaming plan a row at a time (single_layout)."""
        return B > 1 and self.single_layout and self._family() == "stream"

    def _kernels_for(self, B: int, fused: bool) -> tuple[str, ...]:
        """The families a batch-B call's tuner picks from: single_layout keeps every call but the
        plain batch-1 one (which decides) to the family of that one."""
        return (self._family(),) if self.single_layout and (B > 1 or fused) else self.kernels

    def _prepare(self, B: int):
        if B in self._plans:
            return self._plans[B]
        if self._rows_by_one(B):
            return self._prepare(1)
        sms, smem = sm_count(self.device), self._smem()
        if self.fixed_plan is not None and self.fixed_plan.get("kernel") in ("stream", "chunk"):
            chunk = self.fixed_plan["kernel"] == "chunk"
            if B != 1 or self.M not in ((2, 4) if chunk else (2,)):
                raise ValueError(f"a {'chunk' if chunk else 'streaming'} plan runs M={'2 or 4' if chunk else 2} at batch 1, "
                                 f"asked for M={self.M}, batch {B}")
            kw = {k: v for k, v in self.fixed_plan.items() if k != "kernel"}
            smem = OPTIN_SIM if SIM else smem
            plan = (plan_chunk(self.n_out, self.n_in, smem, M=self.M, **kw) if chunk
                    else plan_stream(self.n_out, self.n_in, sms, smem, **kw))
        elif self.fixed_plan is not None:
            plan = plan_additive(self.n_out, self.nchunks, self.M, B, sms, smem, **self.fixed_plan)
        elif self.tune_on_gpu:
            plan = self.tune(B)
        else:
            plan = plan_additive(self.n_out, self.nchunks, self.M, B, sms, smem)
        entry = self._launch_parts(B, plan)
        self._plans[B] = entry
        self._hold("stream" if isinstance(plan, StreamPlan) else "tiled")
        return entry

    def plan(self, B: int = 1) -> AdditivePlan:
        return self._prepare(B)[1]

    def _args(self, xa, tiled, ya, views, fused: tuple = (), plan=None):
        # fused: (g32, res, eps); without fused operations arrays the kernel never reads (not ya: the
        # simulator copies every array argument back after a launch, and an unchanged y would win)
        if isinstance(plan, StreamPlan):  # tiled: the codes in stream_codes' layout
            return (xa, tiled, self._cb32, self._sc, self._bias, ya, views[0], views[1], self.n_out, stream_quads(self.n_out),
                    plan.nch, plan.cps, plan.qpb, self._cbexp) + (fused or (xa, xa, 0.0))
        return (xa, tiled, self._cb32, self._sc, self._bias, ya, views[0], views[1], self.n_out, self.rbs, self.nchunks,
                self._cbexp) + (fused or (xa, xa, 0.0))

    def tune(self, B: int = 1, pre: str = "", post: str = "") -> AdditivePlan:
        """Time every candidate plan (CUDA-graph replays over copies of the codes exceeding the L2)
        and keep the fastest; cached per GPU model and shape. With fused operations (see
        :func:`additive_kernel`) only the tensor-core table builds and the streaming kernel are
        candidates, timed with them."""
        fused = bool(pre or post)
        kernels = self._kernels_for(B, fused)
        key = (torch.cuda.get_device_name(self.device), "additive", self.M, B, self.n_in, self.n_out, pre, post, kernels)
        if key in _TUNED:
            return _TUNED[key]
        from .bench import pick_fastest

        cands = self._candidates(B, pre, post, kernels)
        if not cands:
            raise ValueError(f"no additive plan of {kernels} fits this device's shared memory for M={self.M}, batch {B}"
                             + (f" with {pre or post}" if fused else ""))
        if len(cands) == 1:
            _TUNED[key] = cands[0]
            return cands[0]
        tables = any(isinstance(p, AdditivePlan) for p in cands)
        streaming = any(isinstance(p, StreamPlan) for p in cands)
        # each layout from the one held, or rebuilt once from the natural codes
        natural = (None if (self._tiled_t is not None or not tables) and (self._stream_t is not None or not streaming)
                   else self._natural())
        copies = views = scopies = sviews = None
        if tables:
            tiled = self._tiled_t if self._tiled_t is not None else tile_codes(natural)
            copies, views, xa, ya = tuning_inputs(tiled, self.weight_bytes, self.n_in, self.n_out, B, self.device)
        if streaming:  # the same weight in the streaming layout
            held = self._stream_t if self._stream_t is not None else stream_codes(natural)
            scopies, sviews, sx, sy = tuning_inputs(held, self.weight_bytes, self.n_in, self.n_out, B, self.device)
            if not tables:
                xa, ya = sx, sy
        extra = ()
        if fused:
            xa, extra, _keep = fused_tuning_operands(self.n_in, self.n_out, B, pre, post, self.device)

        def launchers(plan):
            kern, _, grid, owners, kviews = self._launch_parts(B, plan, pre, post)
            codes = sviews if isinstance(plan, StreamPlan) else views
            kern = _with_limit(kern, self._args(xa, codes[0], ya, kviews, extra, plan), plan)

            def launcher(ta):
                args = self._args(xa, ta, ya, kviews, extra, plan)

                def go():
                    _ = owners  # the candidate's workspace lives as long as its launchers
                    stream = cuda.external_stream(torch.cuda.current_stream(self.device).cuda_stream)
                    kern[grid, plan.warps * 32, stream, plan.shared_bytes](*args)
                return go
            return [launcher(v) for v in codes]

        def skip(plan, e):  # a candidate that cannot launch here is skipped, not fatal
            warnings.warn(f"additive plan {plan} skipped: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)

        best = pick_fastest(cands, launchers, self.device, on_error=skip)
        del copies, views, scopies, sviews
        if best is None:
            raise RuntimeError(f"no additive plan launches for M={self.M}, batch {B}, {self.n_in}x{self.n_out}")
        _TUNED[key] = best
        return best

    def _candidates(self, B: int, pre: str, post: str, kernels: tuple[str, ...]) -> list:
        """The plans :meth:`tune` times: the table kernel's (fused: tensor-core builds only) and, at
        batch 1, the streaming and chunk kernels' for M=2 and the chunk kernel's for M=4 (pre='rms': those
        leaving room for its sums of squares)."""
        sms, smem = sm_count(self.device), self._smem()
        cands = [p for p in candidate_plans(self.n_out, self.nchunks, self.M, B, sms, smem)
                 if p.build == "mma" or not (pre or post)] if "table" in kernels else []
        if B == 1 and "stream" in kernels and tuning_enabled("additive-stream"):
            # The fused step's calls (pre or post set) are offered portable clusters only: timed alone,
            # 13B qkv and gate_up ran 7-11 % faster as clusters of 10 chunks and 70B qkv 12 % as one of 16,
            # yet chained in the decode step 13B fell from 374.8 to 355.5 tok/s and 70B moved -0.4 %, while
            # 7B's clusters of 8 beat their global finish there, 584.3 against 550.6. Launched strictly
            # serially the 13B clusters win (351.2 against 338.2): they lose the programmatic overlap
            # (data/_runs/cluster-decode-ab-*-h200.json).
            most = PORTABLE_CLUSTER if pre or post else MAX_CLUSTER
            streams = ((stream_candidates(self.n_out, self.n_in, sms, smem) if self.M == 2 else [])
                       + chunk_candidates(self.n_out, self.n_in, smem, clusters_available(self.device), M=self.M,
                                          max_cluster=most))
            cands += [p for p in streams if pre != "rms" or stream_rms_fits(p, smem)]
        return cands

    def fusable(self, B: int = 1) -> bool:
        """Whether :meth:`bind` can fuse the decode step's pre/post operations at batch ``B``: the
        tensor-core table build and the streaming kernel take them, so a fixed plan must be one of
        those (a tuned or heuristic fused call takes its own)."""
        if B > MAX_FUSED_BATCH:
            return False
        return self.fixed_plan is None or self._prepare(B)[1].build in ("mma", "stream")

    def fused_plan(self, B: int, pre: str, post: str) -> AdditivePlan:
        """The plan a :meth:`bind` with these fused operations launches (tuned for them on a GPU)."""
        return self._prepare_fused(B, pre, post)[1]

    def _prepare_fused(self, B: int, pre: str, post: str):
        k = (B, pre, post)
        if k not in self._fused_plans:
            if self.fixed_plan is not None:
                plan = self._prepare(B)[1]
            elif self.tune_on_gpu:
                plan = self.tune(B, pre, post)
            else:  # the heuristic plan with its table built on the tensor cores
                plan = plan_additive(self.n_out, self.nchunks, self.M, B, sm_count(self.device), self._smem(), build="mma")
            self._fused_plans[k] = self._launch_parts(B, plan, pre, post)
            self._hold("stream" if isinstance(plan, StreamPlan) else "tiled")
        return self._fused_plans[k]

    def bind(self, x: torch.Tensor, out: torch.Tensor, pre: str = "", post: str = "", norm_weight: torch.Tensor | None = None,
             eps: float = 1e-5, res: torch.Tensor | None = None, after_kernel: bool = False):
        """A zero-argument launcher for fixed x and out buffers (views made here, once; it launches on
        torch's stream current at call time, so it can be captured in a CUDA graph). ``pre`` / ``post``:
        the fused operations of :meth:`trapetum.gemv.LutGemv.bind`, with the same operands.
        ``after_kernel``: the launcher always follows a kernel in its stream, so a streaming or chunk
        plan may start while that kernel runs (:class:`trapetum.gemv.programmatic`)."""
        fused = bool(pre or post)
        if fused:
            x2 = check_fused(self, x, out, pre, post, norm_weight, res, "its fixed plan builds its table without the tensor cores")
        else:
            x2 = self.check_input(x)
        B = x2.shape[0]
        check_output(out, B, self.n_out, x2.device)
        if self._rows_by_one(B):
            rows = [self.bind(x2[i:i + 1], out[i:i + 1], pre, post, norm_weight, eps, None if res is None else res[i:i + 1],
                              after_kernel or i > 0)
                    for i in range(B)]

            def launch_rows():
                for go in rows:
                    go()
            return launch_rows
        kern, plan, grid, _owners, views = self._prepare_fused(B, pre, post) if fused else self._prepare(B)
        ya = _as_kernel_array(out)
        xa = _as_kernel_array(x2.view(torch.int32))
        extra, res_src = (), None
        if fused:
            extra, res, res_src = fused_operands(xa, pre, post, norm_weight, res, eps)
        args = self._args(xa, self._stream if isinstance(plan, StreamPlan) else self._tiled, ya, views, extra, plan)
        kern = _with_limit(kern, args, plan)
        block, smem, dev = plan.warps * 32, plan.shared_bytes, self.device
        pdl = after_kernel and isinstance(plan, StreamPlan)  # the kernels whose prologue waits (_stream_parts' start)

        def launch():
            stream = 0 if SIM else cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
            if SIM and post:
                res.copy_(res_src)
            with programmatic(pdl):
                kern[grid, block, stream, smem](*args)
            if SIM:
                out.copy_(torch.from_numpy(ya).view(out.shape))

        return launch

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x2 = self.check_input(x)
        y = out if out is not None else torch.empty(x2.shape[0], self.n_out, dtype=torch.float16, device=x2.device)
        self.bind(x2, y)()
        return y.reshape(self.n_out) if x.dim() == 1 else y

    def dequantize(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The fp16 weight (out, in), rebuilt on the device (torch ops over the untiled codes);
        ``rows=(r0, r1)``: only that slab (r0 a multiple of 32). The decode's fp32 transients are
        ~10x the fp16 weight they make, so large-batch callers go a slab at a time."""
        r0, r1 = check_rows(rows, self.n_out)
        codes = self._natural((r0, r1))
        return _decode(codes, self._codebooks.float(), self._scales[r0:r1].float()).half()


def reference(x: torch.Tensor, t: AdditiveTensor, pre: str = "", post: str = "", norm_weight: torch.Tensor | None = None,
              res: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """float64 reference y = x @ W.T (+ bias) on the CPU; ``pre`` / ``post`` (with their operands):
    the operations :func:`additive_kernel` fuses."""
    W = t.dequantize(torch.float64).cpu()
    y = apply_pre(x.detach().cpu().double(), pre, norm_weight, eps) @ W.T
    return apply_post(y if t.bias is None else y + t.bias.cpu().double(), post, res)


# -- checks and timings for the chapter ------------------------------------------------------
def check_additive(n_in: int, n_out: int, M: int, batch: int, seed: int, device="cuda", plan: dict | None = None,
                   bias: bool = False, tune: bool = True, large: bool = False) -> float:
    """Max relative error of the fused kernel against float64 on fresh inputs, outputs poisoned
    with NaN first; raises AssertionError if any output is left unwritten or is not finite.
    ``large``: codebook entries 64x larger (scales 4096x smaller) and |x| in the thousands, one
    value -60000, so table entries exceed fp16's range (the fp16 table must scale them)."""
    t = random_additive_tensor(n_out, n_in, M, seed=seed, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    if large:
        t = AdditiveTensor(t.codes, t.codebooks * 64, (t.scales.float() / 4096).half(), t.bias)
    if bias:
        t = AdditiveTensor(t.codes, t.codebooks, t.scales, (torch.randn(n_out, generator=g) * 0.1).half().to(device))
    x = torch.randn(batch, n_in, generator=g).half()
    if large:
        x = x * 3000
        x[0, n_in // 2] = -60000.0
    x = x.to(device)
    return poisoned_check(AdditiveGemv(t, device=device, plan=plan, tune=tune), x, lambda x: reference(x, t),
                          f"additive M={M} batch={batch} {n_in}x{n_out} plan={plan}")


def correctness_sweep(shapes, Ms=(2, 4), batches=(1, 2, 3, 8, 16), seed: int = 0, device="cuda", progress: bool = True,
                      tune: bool = False) -> list[dict]:
    """The kernel on fresh random inputs against float64 at every shape, M and batch, plus forced
    plans on the first shape (K-split, row-blocks a block, batch tiles, warps). Shapes are
    (in, out). Plans come from the heuristic unless ``tune`` (tuning compiles every candidate;
    :func:`time_additive` checks the tuned plan it times). Raises AssertionError listing every failure."""
    from tqdm.auto import tqdm

    jobs = [(s, M, b, None) for s in shapes for M in Ms for b in batches]
    # cps=1: one chunk column a K-slice (the deepest K-split); cps=3: slices of 3 (an uneven last one).
    # Plans of 8 warps build the table on the tensor cores (fp32 and fp16 entries), of 4 with multiply-adds.
    jobs += [(shapes[0], M, b, dict(cps=c, RB=rb, bt=bt, warps=w, build="mma" if w == 8 else "fma", table=tb)) for M in Ms
             for b in (1, 3) for c in (1, 3) for rb in (1, 4) for bt in (1, 2) for w in (4, 8)
             for tb in (("fp32", "fp16") if w == 8 else ("fp32",)) if bt <= b]
    # table entries beyond fp16's range ("large" inputs), both tables
    big = [(shapes[0], M, 3, dict(cps=1, bt=2, warps=8, build="mma", table=tb)) for M in Ms for tb in ("fp32", "fp16")]
    # the streaming kernel (M=2, batch 1): K-splits of 1 and 2, 8 and 16 warps, 2 and 3 code slots
    if 2 in Ms:
        big += [(shapes[0], 2, 1, dict(kernel="stream", ksplit=2, warps=16, slots=2))]
        jobs += [(s, 2, 1, dict(kernel="stream", ksplit=ks, warps=w, slots=d)) for s in shapes[:2] for ks in (1, 2) for w, d in ((8, 3), (16, 2))]
    # the chunk kernel (M=4: two M=2 halves): tiles of 16 and 32 rows, one row-group and several
    for M in Ms:
        big += [(shapes[0], M, 1, dict(kernel="chunk", warps=8, tile=8, rows=512))]
        jobs += [(s, M, 1, dict(kernel="chunk", warps=w, tile=qt, rows=r)) for s in shapes[:2] for w, qt, r in ((8, 4, 256), (16, 4, 1024))]
        # its cluster finish (2 to MAX_CLUSTER chunks, sm_90 and later): the shapes whose inputs allow it
        if clusters_available(device):
            cl = [s for s in shapes if 1 < stream_chunks(s[0] // D) * (M // 2) <= MAX_CLUSTER][:2]
            big += [(s, M, 1, dict(kernel="chunk", warps=8, tile=8, rows=512, cluster=True)) for s in cl[:1]]
            jobs += [(s, M, 1, dict(kernel="chunk", warps=w, tile=qt, rows=r, cluster=True)) for s in cl
                     for w, qt, r in ((8, 4, 512), (16, 4, 1024))]
    jobs += big
    recs, failures = [], []
    for i, job in enumerate(tqdm(jobs, desc="additive correctness", disable=not progress)):
        (n_in, n_out), M, b, plan = job
        large = job in big
        try:
            err = check_additive(n_in, n_out, M, b, seed=seed + i, device=device, plan=plan, bias=i % 2 == 1, tune=tune,
                                 large=large)
            ok = err <= TOLERANCE
        except Exception as e:  # noqa: BLE001 - a driver error names its plan and the sweep goes on
            err, ok = float("nan"), False
            failures.append(str(e) if isinstance(e, AssertionError) else f"{type(e).__name__} at plan={plan} "
                            f"batch={b} {n_in}x{n_out}: {e}")
        recs.append({"kernel": "additive", "M": M, "scheme": SCHEMES[M], "batch": b, "in_features": n_in, "out_features": n_out,
                     "max_rel_err": err, "passed": ok, "plan": str(plan) if plan else "tuned",
                     "inputs": "large" if large else "normal"})
        if not ok and err == err:
            failures.append(f"additive M={M} batch={b} {n_in}x{n_out} plan={plan}: max rel err {err:.3g} > {TOLERANCE}")
    if failures:
        raise AssertionError("additive correctness sweep failed:\n" + "\n".join(failures))
    return recs


def additive_launchers(n_in: int, n_out: int, M: int, batch: int, seed: int = 0, pre: str = "", post: str = "",
                       kernels: tuple[str, ...] = AdditiveGemv.FAMILIES, single_layout: bool = False):
    """Rotated copies of one random additive weight (each AdditiveGemv holds its own codes),
    all bound to the same x and y (with ``pre`` / ``post``, the fused operations' operands:
    :func:`trapetum.bench.bind_rotated`)."""
    from .bench import bind_rotated, copies_for

    t = random_additive_tensor(n_out, n_in, M, seed=seed, device="cuda")
    gemvs = [AdditiveGemv(t, kernels=kernels, single_layout=single_layout) for _ in range(copies_for(t.nbytes))]
    launchers, x, y = bind_rotated(gemvs, n_in, n_out, batch, pre, post)
    return launchers, (gemvs, x, y, t)


def time_fused_additive(n_in: int, n_out: int, M: int, pre: str = "", post: str = "", seed: int = 0) -> float:
    """Milliseconds of one batch-1 additive kernel with fused operations, as
    :class:`trapetum.step.FusedStep` launches it (as :class:`trapetum.qlinear.AdditiveQLinear` builds it:
    the family of its plain batch-1 plan, at its own tuned fused plan), timed as
    :func:`trapetum.bench.time_graph` replays over rotated copies. Correctness of these kernels is
    :func:`trapetum.step.kernel_checks`'s."""
    from .bench import time_graph

    launchers, keep = additive_launchers(n_in, n_out, M, 1, seed=seed, pre=pre, post=post, single_layout=True)
    ms = time_graph(launchers)
    del launchers, keep
    torch.cuda.empty_cache()
    return ms


def time_additive(n_in: int, n_out: int, M: int, batch: int, fp16_ms: float, seed: int = 0) -> dict:
    """One timing record (as bench.gemv_record): CUDA-graph replays over L2-exceeding copies, the
    plan tuned first, and the error checked on fresh inputs with outputs poisoned."""
    from .bench import gemv_record, time_graph

    launchers, keep = additive_launchers(n_in, n_out, M, batch, seed=seed)
    ms = time_graph(launchers)
    g, t = keep[0][0], keep[3]
    plan = g.plan(batch)
    err = check_additive(n_in, n_out, M, batch, seed=seed + 7)
    nbytes = g.weight_bytes + 2 * batch * (n_in + n_out)
    bits = t.bits_per_weight
    del launchers, keep, g, t
    torch.cuda.empty_cache()
    return gemv_record("additive", K, batch, n_in, n_out, ms, fp16_ms, nbytes, err, scheme=SCHEMES[M], M=M, bits_per_weight=bits,
                       passed=err <= TOLERANCE, ksplit=plan.ksplit, warps=plan.warps, rb=getattr(plan, "RB", None), cps=plan.cps,
                       bt=getattr(plan, "bt", 1), shared_bytes=plan.shared_bytes, build=plan.build,
                       table=getattr(plan, "table", "fp16"), plan=plan.label())
