"""Projections that read the same input, fused into one weight: q/k/v and gate/up (gpt-fast's
``wqkv`` and ``w13``, vLLM's QKVParallelLinear and MergedColumnParallelLinear).

Why: at batch 1 a codebook GEMV at mid shapes is not limited by bytes but by one wave of blocks,
each a chain of prologue, stream and finish (NOTES.md, "Additive v3"); one 12288 x 4096 launch
costs less than three 4096 x 4096 ones, and the graph has fewer nodes. Rows are independent in
every format here (scalar codebooks are per output row, additive scales are per row), so a fused
weight is the parts' rows stacked: the same numbers, one kernel.

transformers' attention and MLP code runs unchanged, whatever its version: ``q_proj``, ``k_proj``
and ``v_proj`` (``gate_proj``, ``up_proj``) become :class:`ProjectionPart` views of one
:class:`FusedProjections` kept on their parent as ``qkv_proj`` (``gate_up_proj``). The first part
computes every output; a later part slices them only when it is handed the very tensor the first
part was, and recomputes otherwise, so an unusual call order costs time, never a wrong answer.

Additive (AQLM-style) and residual (VPTQ-style) layers share their codebooks across a layer's rows,
so they fuse only when the parts' codebooks (and a residual layer's input-channel norm) are equal: a
group quantized jointly. An AQLM checkpoint's separate codebooks stay unfused and the report says why.
"""
from __future__ import annotations

import torch
from torch import nn

from .qlinear import AdditiveQLinear, QLinear, ResidualQLinear

# fused name -> the projections it replaces, in the order transformers' Llama code calls them
GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class FusedProjections(nn.Module):
    """One linear layer (nn.Linear or any QLinear) whose output rows are several projections';
    ``forward`` returns their outputs as a tuple of views."""

    def __init__(self, linear: nn.Module, sizes: tuple[int, ...], names: tuple[str, ...]):
        super().__init__()
        if sum(sizes) != linear.out_features:
            raise ValueError(f"part sizes {sizes} do not add up to out_features={linear.out_features}")
        self.linear, self.sizes, self.names = linear, tuple(sizes), tuple(names)
        self._x = self._parts = None

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(self.linear(x), self.sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"parts={dict(zip(self.names, self.sizes))}"


class ProjectionPart(nn.Module):
    """Stands where one fused projection stood; ``part(x)`` is that projection's output."""

    def __init__(self, group: FusedProjections, index: int):
        super().__init__()
        # Not a submodule: the group's weight belongs to the parent, once in its state_dict.
        self.__dict__["group"] = group
        self.index = index
        self.in_features, self.out_features = group.in_features, group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        if self.index == 0 or g._x is not x:
            g._x, g._parts = x, g(x)
        y = g._parts[self.index]
        if self.index == len(g.sizes) - 1:
            g._x = g._parts = None  # hold no activation past the layer call
        return y

    def extra_repr(self) -> str:
        return f"{self.group.names[self.index]} = rows {sum(self.group.sizes[:self.index])}..{sum(self.group.sizes[:self.index + 1])} of the fused layer"


def _why_not(mods: list[nn.Module]) -> str | None:
    """None if these layers can be stacked into one, else the reason."""
    kinds = {type(m) for m in mods}
    if len(kinds) != 1:
        return "mixed layer types " + ", ".join(sorted(k.__name__ for k in kinds))
    kind = kinds.pop()
    if kind not in (nn.Linear, QLinear, AdditiveQLinear, ResidualQLinear):
        return f"{kind.__name__} layers are not fusable"
    if len({m.in_features for m in mods}) != 1:
        return "different in_features"
    if len({m.bias is None for m in mods}) != 1:
        return "some have a bias and some do not"
    if len({getattr(m, "rotation", None) for m in mods}) != 1:
        return "different input rotations"
    if kind is nn.Linear:
        if len({(m.weight.dtype, m.weight.device) for m in mods}) != 1:
            return "weights of different dtypes or devices"
    elif kind is QLinear:
        if len({m.K for m in mods}) != 1:
            return "different K"
    elif kind is ResidualQLinear:
        if len({m.K for m in mods}) != 1:
            return "different codebook sizes"
        if not all(_same(m, mods[0], kind.SHARED) for m in mods[1:]):
            return "residual layers with different codebooks or norms (a group fuses only if quantized jointly)"
    else:
        # the codebooks buffer stays on the module when the kernel takes the codes: no rebuild needed
        if len({m.M for m in mods}) != 1:
            return "different numbers of codebooks"
        if not all(_same(m, mods[0], kind.SHARED) for m in mods[1:]):
            return "additive layers with different codebooks (a group fuses only if quantized jointly)"
    return None


def _same(a: nn.Module, b: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether buffers ``names`` of a and b are equal (both None counts as equal)."""
    for n in names:
        x, y = getattr(a, n), getattr(b, n)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return False
    return True


@torch.no_grad()
def stack(mods: list[nn.Module]) -> nn.Module:
    """One layer whose output rows are ``mods``' outputs in order (see :func:`_why_not` for which)."""
    why = _why_not(mods)
    if why:
        raise ValueError(f"cannot fuse these projections: {why}")
    return _stack(mods)


def _stack(mods: list[nn.Module]) -> nn.Module:
    bias = None if mods[0].bias is None else torch.cat([m.bias for m in mods])
    first = mods[0]
    if isinstance(first, ResidualQLinear):
        from .residual import ResidualTensor

        ts = [m.codebook_tensor() for m in mods]
        t = ResidualTensor(torch.cat([t.indices for t in ts]), ts[0].main, ts[0].res, first.in_features,
                           sum(m.out_features for m in mods), ts[0].scale, ts[0].bias)
        new = ResidualQLinear.from_residual(t, bias)
    elif isinstance(first, AdditiveQLinear):
        from .additive import AdditiveTensor

        ts = [m.codebook_tensor() for m in mods]
        t = AdditiveTensor(torch.cat([t.codes for t in ts]), ts[0].codebooks, torch.cat([t.scales for t in ts]))
        new = AdditiveQLinear.from_additive(t, bias)
    elif isinstance(first, QLinear):
        from .codebook import CodebookTensor

        ts = [m.codebook_tensor() for m in mods]
        ct = CodebookTensor(torch.cat([t.codes for t in ts]), torch.cat([t.codebook for t in ts]), first.K,
                            first.in_features, sum(m.out_features for m in mods))
        new = QLinear.from_codebook(ct, bias)
    else:
        new = nn.Linear(first.in_features, sum(m.out_features for m in mods), bias=bias is not None, device="meta")
        new.weight = nn.Parameter(torch.cat([m.weight for m in mods]), requires_grad=first.weight.requires_grad)
        if bias is not None:
            new.bias = nn.Parameter(bias, requires_grad=first.bias.requires_grad)
    if isinstance(first, QLinear):
        new.mode, new.simulate, new.rotation = first.mode, first.simulate, first.rotation
    return new


def fuse_projections(model: nn.Module) -> dict[str, str]:
    """Fuse every q/k/v and gate/up group of ``model`` in place (see the module docstring).

    Returns ``{parent.fused_name: "fused" or the reason it was left alone}``. Fusing twice is a
    no-op. A fused model decodes as before; :func:`trapetum.qlinear.save_quantized` refuses it
    (the saved format keeps transformers' layer names): save first, fuse after loading.
    """
    report = {}
    for pname, parent in list(model.named_modules()):
        for fused, names in GROUPS.items():
            if not all(hasattr(parent, n) for n in names):
                continue
            key = f"{pname}.{fused}" if pname else fused
            mods = [getattr(parent, n) for n in names]
            if all(isinstance(m, ProjectionPart) for m in mods):
                report[key] = "fused"
                continue
            why = _why_not(mods)
            if why:
                report[key] = why
                continue
            group = FusedProjections(_stack(mods), tuple(m.out_features for m in mods), names)
            setattr(parent, fused, group)
            for i, n in enumerate(names):
                setattr(parent, n, ProjectionPart(group, i))
            report[key] = "fused"
    return report


def is_fused(model: nn.Module) -> bool:
    return any(isinstance(m, FusedProjections) for m in model.modules())
