"""The scalar codebook format: codes plus one fp16 codebook per output channel.

W[o, i] = codebook[o, q[o, i]].  Packing:

* K = 16: 4 bits a code, two codes a byte, low nibble = even column ("4bit-lo");
* K = 64 or 256: one code a byte ("u8").

On disk a layer is a safetensors file with tensors ``codes`` and ``codebook`` and a JSON
header under the metadata key ``trapetum`` (format version, shapes, K, packing and a SHA-256
of each tensor's bytes), so truncation and tampering are caught at load time.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .kmeans import KMeansReport, check_finite, kmeans_rows

FORMAT_VERSION = 1
SUPPORTED_K = (16, 64, 256)
ROW_BLOCK = 32  # rows a warp owns in the kernel layout: lane l <-> row rb*32 + l
CHUNK_BYTES = 16  # one 128-bit load a lane


class CodebookFormatError(ValueError):
    """A codebook file or tensor does not follow the format (corrupt, tampered or mismatched)."""


def packing_for(K: int) -> str:
    if K not in SUPPORTED_K:
        raise ValueError(f"K must be one of {SUPPORTED_K}, got {K}")
    return "4bit-lo" if K == 16 else "u8"


def codes_per_byte(K: int) -> int:
    return 2 if packing_for(K) == "4bit-lo" else 1


def check_in_features(in_features: int, K: int) -> None:
    """in_features must fill whole 16-byte chunks: 32 columns (4-bit) or 16 (uint8)."""
    cols = CHUNK_BYTES * codes_per_byte(K)
    if in_features <= 0 or in_features % cols:
        raise ValueError(
            f"in_features={in_features} is not divisible by {cols}: K={K} packs "
            f"{codes_per_byte(K)} code(s) a byte and the kernels read 16-byte chunks"
        )


def pack_codes(q: torch.Tensor, K: int) -> torch.Tensor:
    """(out, in) integer codes in [0, K) -> packed uint8 in the natural layout."""
    if q.dim() != 2:
        raise ValueError(f"codes must be 2-D, got shape {tuple(q.shape)}")
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {q.dtype}")
    qi = q.to(torch.int32)
    if qi.numel() and (int(qi.min()) < 0 or int(qi.max()) >= K):
        raise ValueError(f"codes out of range: found [{int(qi.min())}, {int(qi.max())}], K={K} allows [0, {K - 1}]")
    check_in_features(q.shape[1], K)
    if packing_for(K) == "u8":
        return qi.to(torch.uint8).contiguous()
    return (qi[:, 0::2] | (qi[:, 1::2] << 4)).to(torch.uint8).contiguous()


def unpack_codes(packed: torch.Tensor, K: int) -> torch.Tensor:
    """Inverse of pack_codes: uint8 (out, in) codes."""
    if packing_for(K) == "u8":
        return packed
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=2).reshape(packed.shape[0], -1)


@dataclass
class CodebookTensor:
    """A quantized weight: packed codes (natural layout) and fp16 codebooks, one row each."""

    codes: torch.Tensor  # uint8 (out, in / codes_per_byte)
    codebook: torch.Tensor  # float16 (out, K)
    K: int
    in_features: int
    out_features: int

    def __post_init__(self):
        self.validate()

    @property
    def packing(self) -> str:
        return packing_for(self.K)

    @property
    def bits_per_weight(self) -> float:
        """Code bits plus the codebook's share (K fp16 entries per row)."""
        code_bits = 8 // codes_per_byte(self.K)
        return code_bits + self.K * 16 / self.in_features

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.codebook.numel() * 2

    def validate(self, check_range: bool = True) -> None:
        K, n_in, n_out = self.K, self.in_features, self.out_features
        packing_for(K)
        check_in_features(n_in, K)
        if self.codes.dtype != torch.uint8:
            raise CodebookFormatError(f"codes must be uint8, got {self.codes.dtype}")
        if self.codebook.dtype != torch.float16:
            raise CodebookFormatError(f"codebook must be float16, got {self.codebook.dtype}")
        want = (n_out, n_in // codes_per_byte(K))
        if tuple(self.codes.shape) != want:
            raise CodebookFormatError(f"codes shape {tuple(self.codes.shape)} != {want} for out={n_out}, in={n_in}, K={K}")
        if tuple(self.codebook.shape) != (n_out, K):
            raise CodebookFormatError(f"codebook shape {tuple(self.codebook.shape)} != {(n_out, K)}")
        if self.codes.device != self.codebook.device:
            raise CodebookFormatError(f"codes on {self.codes.device} but codebook on {self.codebook.device}")
        if not torch.isfinite(self.codebook).all():
            raise CodebookFormatError("codebook has NaN/Inf entries")
        if check_range and K < 256 and self.packing == "u8" and self.codes.numel() and int(self.codes.max()) >= K:
            raise CodebookFormatError(f"codes out of range: max code {int(self.codes.max())} >= K={K}")

    def to(self, device) -> "CodebookTensor":
        return CodebookTensor(self.codes.to(device), self.codebook.to(device), self.K, self.in_features, self.out_features)

    def dequantize(self, dtype=torch.float16) -> torch.Tensor:
        """The (out, in) weight this tensor stands for."""
        q = unpack_codes(self.codes, self.K).long()
        return self.codebook.to(dtype).gather(1, q)

    # -- serialization -------------------------------------------------------------------
    def header(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "kind": "scalar-codebook",
            "K": self.K,
            "packing": self.packing,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "codes_shape": list(self.codes.shape),
            "codebook_shape": list(self.codebook.shape),
            "codebook_dtype": "float16",
            "sha256": {"codes": _sha(self.codes), "codebook": _sha(self.codebook)},
        }

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {"codes": self.codes.detach().cpu().contiguous(), "codebook": self.codebook.detach().cpu().contiguous()}
        save_file(tensors, str(path), metadata={"trapetum": json.dumps(self.header())})
        return path

    @classmethod
    def load(cls, path: str | Path, device="cpu") -> "CodebookTensor":
        h, tensors = read_layer_file(path, "scalar-codebook", FORMAT_VERSION, "codebook")
        names = set(tensors)
        if names != {"codes", "codebook"}:
            raise CodebookFormatError(f"{path}: expected tensors codes and codebook, found {sorted(names)}")
        try:
            K, n_in, n_out = int(h["K"]), int(h["in_features"]), int(h["out_features"])
        except (KeyError, TypeError, ValueError) as e:
            raise CodebookFormatError(f"{path}: header lacks K/in_features/out_features: {e}") from e
        if K not in SUPPORTED_K:
            raise CodebookFormatError(f"{path}: K={K} is not one of {SUPPORTED_K}")
        if h.get("packing") != packing_for(K):
            raise CodebookFormatError(f"{path}: packing {h.get('packing')!r} does not fit K={K}")
        codes, cb = tensors["codes"], tensors["codebook"]
        for name, t in (("codes", codes), ("codebook", cb)):
            if list(t.shape) != h.get(f"{name}_shape"):
                raise CodebookFormatError(f"{path}: {name} shape {list(t.shape)} != header {h.get(f'{name}_shape')}")
            if _sha(t) != h.get("sha256", {}).get(name):
                raise CodebookFormatError(f"{path}: {name} bytes do not match the header's SHA-256 (file tampered or corrupt)")
        try:
            ct = cls(codes, cb, K, n_in, n_out)
        except (ValueError, TypeError) as e:
            raise CodebookFormatError(f"{path}: {e}") from e
        return ct.to(device)


def read_layer_file(path: str | Path, kind: str, version: int, what: str) -> tuple[dict, dict]:
    """(header, tensors) of a Trapetum layer file, after the checks every format shares: the file
    exists and reads as safetensors, carries a JSON 'trapetum' header of this kind and version."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CodebookFormatError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e
    if "trapetum" not in meta:
        raise CodebookFormatError(f"{path}: no 'trapetum' header in the safetensors metadata")
    try:
        h = json.loads(meta["trapetum"])
    except json.JSONDecodeError as e:
        raise CodebookFormatError(f"{path}: the 'trapetum' header is not JSON: {e}") from e
    if h.get("format_version") != version:
        raise CodebookFormatError(f"{path}: format_version {h.get('format_version')!r}, this trapetum reads {version}")
    if h.get("kind") != kind:
        raise CodebookFormatError(f"{path}: kind {h.get('kind')!r} is not {kind!r}")
    return h, tensors


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def quantize(
    W: torch.Tensor,
    K: int = 16,
    iters: int = 25,
    seed: int = 0,
    importance: torch.Tensor | None = None,
    device=None,
) -> tuple[CodebookTensor, KMeansReport]:
    """Per-output-channel k-means of an (out, in) weight into a CodebookTensor (on W's device)."""
    packing_for(K)
    if W.dim() != 2:
        raise ValueError(f"W must be 2-D (out_features, in_features), got shape {tuple(W.shape)}")
    check_in_features(W.shape[1], K)
    check_finite(W)
    q, cb, rep = kmeans_rows(W, K, iters=iters, seed=seed, importance=importance, device=device)
    ct = CodebookTensor(pack_codes(q, K), cb.to(torch.float16), K, W.shape[1], W.shape[0])
    return ct, rep


def random_codebook_tensor(out_features: int, in_features: int, K: int, seed: int = 0, device="cpu",
                           generator: torch.Generator | None = None) -> CodebookTensor:
    """Random codes and sorted normal codebooks, made on ``device``: what speed benchmarks use
    (speed does not depend on values). No CPU pass, so 7B-70B layers are built in place."""
    check_in_features(in_features, K)
    g = generator if generator is not None else torch.Generator(device=device).manual_seed(seed)
    hi = 256 if K == 16 else K  # for K=16 a random byte is two valid 4-bit codes
    codes = torch.randint(0, hi, (out_features, in_features // codes_per_byte(K)), dtype=torch.uint8, device=device, generator=g)
    cb = torch.randn(out_features, K, device=device, generator=g).sort(dim=1).values * 0.02
    return CodebookTensor(codes, cb.half(), K, in_features, out_features)


# -- kernel layout ---------------------------------------------------------------------------
def tile(ct: CodebookTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast kernels' layout, built once per layer on its device.

    codes: rows padded to a multiple of 32; tiled[((rb * nchunks + j) * 32 + lane) * 16 + t]
    = codes[rb * 32 + lane, j * 16 + t], returned as int32 words, so a warp reading chunk j of
    row-block rb reads 512 contiguous bytes with one 16-byte load a lane.
    codebook: (row-blocks, K, 32) fp16, so a block copies its 32 rows' tables with coalesced loads.
    """
    n_out, nbytes = ct.codes.shape
    rbs = -(-n_out // ROW_BLOCK)
    pad = rbs * ROW_BLOCK - n_out
    codes, cb = ct.codes, ct.codebook
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, nbytes)])
        cb = torch.cat([cb, cb.new_zeros(pad, ct.K)])
    nchunks = nbytes // CHUNK_BYTES
    tiled = codes.reshape(rbs, ROW_BLOCK, nchunks, CHUNK_BYTES).permute(0, 2, 1, 3).contiguous()
    cbt = cb.reshape(rbs, ROW_BLOCK, ct.K).permute(0, 2, 1).contiguous()
    return tiled.view(torch.int32).reshape(-1), cbt


def untile(tiled: torch.Tensor, out_features: int, nbytes: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The natural (out, nbytes) uint8 codes back from :func:`tile`'s int32 words (a copy).

    ``rows=(r0, r1)``: only those rows (r0 a multiple of 32), read from their row-blocks alone, so
    a caller rebuilding a weight a slab at a time never holds the whole natural copy."""
    rbs = -(-out_features // ROW_BLOCK)
    nchunks = nbytes // CHUNK_BYTES
    if tiled.numel() * 4 != rbs * ROW_BLOCK * nbytes:
        raise ValueError(f"tiled codes hold {tiled.numel() * 4} bytes, not {rbs * ROW_BLOCK} x {nbytes}")
    r0, r1 = check_rows(rows, out_features)
    rb0, rb1 = r0 // ROW_BLOCK, -(-r1 // ROW_BLOCK)
    words = ROW_BLOCK * nbytes // 4  # a row-block's words are contiguous
    t = tiled[rb0 * words:rb1 * words].view(torch.uint8).reshape(rb1 - rb0, nchunks, ROW_BLOCK, CHUNK_BYTES).permute(0, 2, 1, 3)
    return t.reshape((rb1 - rb0) * ROW_BLOCK, nbytes)[:r1 - r0].contiguous()


def check_rows(rows: tuple[int, int] | None, out_features: int) -> tuple[int, int]:
    """(r0, r1) of a row slab, checked: 0 <= r0 < r1 <= out_features and r0 on a row-block boundary."""
    if rows is None:
        return 0, out_features
    r0, r1 = (int(r) for r in rows)
    if not 0 <= r0 < r1 <= out_features or r0 % ROW_BLOCK:
        raise ValueError(f"rows must be (r0, r1) with 0 <= r0 < r1 <= {out_features} and r0 a multiple of {ROW_BLOCK}, got {rows}")
    return r0, r1
