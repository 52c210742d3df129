"""Tables and figures of the chapter "The bandwidth law" (notebooks/gemv.ipynb).

Everything the chapter shows is computed here from the results files ``data/<gpu>/gemv.json``
(see :mod:`trapetum.results`); the notebook only loads, calls and shows. The one exception is
:data:`SEED_004`: numbers quoted from the seed project's benchmark report, which are always
shown beside ours under a label that says they were *reported by the seed*, never measured here.

Every function takes the DataFrame of :func:`load_gemv` (or a results folder), so the tests can
run them on synthetic data. Figures are plain :class:`matplotlib.figure.Figure` objects (not
registered with pyplot): a notebook shows the returned figure exactly once, and nothing leaks.
"""
from __future__ import annotations

import ast
import json
import math
import re
from contextlib import contextmanager
from pathlib import Path

import matplotlib as mpl
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from . import results

NAME = "gemv"

# -- numbers quoted from the seed ------------------------------------------------------------
# Quoted verbatim from the seed project's benchmark report, seed 004
# (shared/seeds/004_e73dd109321271dd.txt, sections "by layer shape" and "The bandwidth law").
# They were NOT measured by us: every table and figure labels them "reported by the seed".
# These are the only numbers in this module that do not come from data/.
SEED_004 = {
    "source": "seed report 004 (e73dd109321271dd)",
    # Speedup of the seed's codebook_gemv op vs torch.mv (dense fp16), RTX 4090, batch 1,
    # keyed by (in_features, out_features) = the seed's (IC, OC).
    "layers_gpu": "RTX 4090",
    "layers_baseline": "torch.mv",
    "layers": {
        (3072, 768): 0.58,
        (4096, 4096): 2.10,
        (11008, 4096): 3.70,
        (4096, 11008): 3.77,
    },
    # The seed's "bandwidth law": its 4-bit K=16 kernel vs cuBLAS fp16 at IC = OC = 4096, batch 1.
    # bandwidth_tbps is the seed's nominal bandwidth class ("~1.0 TB/s"), not a measurement.
    "bandwidth_law_shape": (4096, 4096),
    "bandwidth_law": [
        {"gpu": "RTX 4090", "arch": "sm_89", "bandwidth_tbps": 1.0, "speedup": 2.20},
        {"gpu": "A40", "arch": "sm_86", "bandwidth_tbps": 0.7, "speedup": 2.34},
        {"gpu": "H100 PCIe", "arch": "sm_90", "bandwidth_tbps": 3.3, "speedup": 0.99},
    ],
}

# What the layer shapes are (names only, from the seed's table and Llama-2 7B's layers).
LAYER_ROLES = {
    (3072, 768): "small",
    (4096, 4096): "attention projection",
    (11008, 4096): "MLP down",
    (4096, 11008): "MLP up",
}

MEASURED = "measured here"
SEED = "reported by the seed"

BASELINE = "torch fp16"
KERNEL_LABELS = {
    "torch fp16": "torch fp16 (cuBLAS), the baseline",
    "lut": "lut: fused LUT-GEMV (4-bit: the fastest of lut-fma, mma, dual and, from batch 4, wide and tile, tuned per shape)",
    "lut-fma": "lut-fma: fp32 table, FMA (numba)",
    "mma": "mma: pair table + tensor cores (numba)",
    "dual": "dual: pair table + tensor cores, weights as A (numba)",
    "lut32": "lut32: 4-byte loads (negative result)",
    "naive": "naive: untiled (negative result)",
    "dequant+cublas": "dequant+cublas: dequantize, then cuBLAS",
    "cuda_cpp_4bit": "cuda_cpp_4bit: CUDA C++ twin of lut",
    "cuda_cpp_4bit_mma": "cuda_cpp_4bit_mma: CUDA C++, pair table + tensor cores",
    "cuda_cpp_4bit_dual": "cuda_cpp_4bit_dual: CUDA C++ twin of dual",
    "cuda_cpp_u8": "cuda_cpp_u8: CUDA C++ counterpart",
}
KERNEL_ORDER = ["torch fp16", "lut", "lut-fma", "mma", "dual", "cuda_cpp_4bit", "cuda_cpp_4bit_mma", "cuda_cpp_4bit_dual", "cuda_cpp_u8", "lut32",
                "naive", "dequant+cublas"]
SCHEME_OF_K = {16: "4-bit K=16", 64: "uint8 K=64", 256: "uint8 K=256"}
SCHEME_ORDER = ["dense fp16", "4-bit K=16", "uint8 K=64", "uint8 K=256"]
# The kernels whose speed the chapter is about (the others are ablations or the baseline).
PRODUCT_KERNELS = ("lut", "cuda_cpp_4bit", "cuda_cpp_4bit_mma", "cuda_cpp_4bit_dual", "cuda_cpp_u8")
FOUR_BIT = "4-bit K=16"
FLOOR_GRID = "floor"  # the gemv suite's streaming-floor records (bench.time_stream), read by floor_table only

_SCHEME_COLORS = {
    "4-bit K=16": "#1f77b4",
    "uint8 K=64": "#ff7f0e",
    "uint8 K=256": "#2ca02c",
    "dense fp16": "#555555",
}
_MARKERS = ["o", "s", "D", "^", "v", "P", "X"]


class NoRecordedDataError(FileNotFoundError):
    """No GPU has recorded the chapter's measurements in the data folder."""


# -- loading ---------------------------------------------------------------------------------
def _root(folder) -> Path:
    return Path(folder) if folder is not None else results.DATA_DIR


def _files(folder) -> list[Path]:
    return sorted(_root(folder).glob(f"*/{NAME}.json"))


def load_gemv(folder=None) -> pd.DataFrame:
    """Every recorded GPU's ``gemv.json`` as one DataFrame; raises if there is none.

    ``folder`` defaults to the repository's ``data/`` (resolved from the package, not from the
    working directory). Records without ``copy_gbps`` get the run's provenance value.
    """
    root = _root(folder)
    df = results.load(NAME, root)
    if df.empty:
        raise NoRecordedDataError(
            f"no GPU has recorded the GEMV measurements: found no {root}/<gpu>/{NAME}.json with records. "
            "Measure on a CUDA GPU with `trapetum gemv` (or run this notebook with papermill "
            "-p measure True), then rebuild the book."
        )
    copy = {p.parent.name: results.read(p)[0].get("copy_gbps") for p in _files(root)}
    if "copy_gbps" not in df:
        df["copy_gbps"] = np.nan
    fill = df["gpu_slug"].map(copy).astype(float)
    df["copy_gbps"] = df["copy_gbps"].astype(float).fillna(fill)
    return _normalise(df)


def _normalise(df: pd.DataFrame) -> pd.DataFrame:
    """Columns every function relies on, whatever an older or newer results file holds."""
    df = df.copy()
    for col, default in (("gpu", "unknown GPU"), ("grid", None), ("scheme", None), ("K", np.nan),
                         ("batch", 1), ("copy_gbps", np.nan), ("max_rel_err", np.nan), ("gbps", np.nan),
                         ("time_ms", np.nan), ("fp16_ms", np.nan), ("speedup", np.nan),
                         ("l2_resident_ms", np.nan), ("empty_launch_ms", np.nan)):
        if col not in df:
            df[col] = default
    df["gpu"] = df["gpu"].fillna("unknown GPU")
    # The CUDA C++ program times several kernel designs: every one but the numba twin ("lut")
    # is a kernel of its own in the tables.
    if "variant" in df:
        other = df["kernel"].isin(("cuda_cpp_4bit", "cuda_cpp_u8")) & df["variant"].notna() & (df["variant"] != "lut")
        df.loc[other, "kernel"] = df.loc[other, "kernel"] + "_" + df.loc[other, "variant"].astype(str)
    if "gpu_slug" not in df:
        df["gpu_slug"] = df["gpu"].map(results.slug)
    missing = df["scheme"].isna() & df["K"].notna()
    df.loc[missing, "scheme"] = df.loc[missing, "K"].map(lambda k: SCHEME_OF_K.get(int(k), f"K={int(k)}"))
    df.loc[df["scheme"].isna() & (df["kernel"] == BASELINE), "scheme"] = "dense fp16"
    return df


def _timed(df: pd.DataFrame) -> pd.DataFrame:
    """Timing records only (no correctness checks), with bytes moved and short labels added."""
    df = _normalise(df)
    d = df[~df["grid"].isin(("correctness", FLOOR_GRID)) & df["time_ms"].notna()].copy()
    # bytes the harness counted for this call (weights + x + y), recovered from GB/s x time
    d["bytes"] = d["gbps"] * d["time_ms"] * 1e6
    d["shape"] = list(zip(d["in_features"].astype(int), d["out_features"].astype(int)))
    d["gpu_label"] = d["gpu"].map(gpu_label)
    return d


def gpu_label(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100 80GB HBM3'."""
    name = str(name)
    return name[len("NVIDIA "):] if name.startswith("NVIDIA ") else name


def shape_label(shape) -> str:
    return f"{int(shape[0])} x {int(shape[1])}"


def _gpus(d: pd.DataFrame) -> list[str]:
    """GPU names, the most bandwidth-limited (lowest measured copy bandwidth) first."""
    bw = d.groupby("gpu")["copy_gbps"].max().fillna(np.inf)
    return sorted(bw.index, key=lambda g: (bw[g], g))


def _kernel_rank(k: str) -> int:
    return KERNEL_ORDER.index(k) if k in KERNEL_ORDER else len(KERNEL_ORDER)


def _scheme_rank(s) -> int:
    return SCHEME_ORDER.index(s) if s in SCHEME_ORDER else len(SCHEME_ORDER)


def series_label(kernel: str, scheme) -> str:
    if kernel == BASELINE:
        return "torch fp16 (cuBLAS)"
    return f"{kernel}, {scheme}"


def _baseline_bytes(d: pd.DataFrame) -> pd.Series:
    """Bytes torch fp16 moved for each record's (gpu, shape, batch), from the baseline records."""
    base = d[d["kernel"] == BASELINE].drop_duplicates(["gpu", "in_features", "out_features", "batch"])
    key = ["gpu", "in_features", "out_features", "batch"]
    m = d[key].merge(base[key + ["bytes"]], on=key, how="left")
    return pd.Series(m["bytes"].to_numpy(), index=d.index)


# -- tables ----------------------------------------------------------------------------------
def kernel_table(df: pd.DataFrame, shape=(4096, 4096), batch: int = 1) -> pd.DataFrame:
    """Every kernel at one shape and batch, per GPU, baseline first: the seed's kernel table.

    Columns: GPU | Kernel | Scheme | Latency (ms) | vs cuBLAS | Max rel. err | GB/s, numeric
    (format for display with :func:`styled`). "vs cuBLAS" is torch fp16 time / kernel time,
    both timed in the same run.
    """
    d = _timed(df)
    d = d[(d["in_features"] == shape[0]) & (d["out_features"] == shape[1]) & (d["batch"] == batch)]
    if d.empty:
        raise ValueError(f"no timing at {shape_label(shape)}, batch {batch}, in the recorded data")
    d = d.drop_duplicates(["gpu", "kernel", "K"])
    gpus = _gpus(d)
    d = d.assign(_g=d["gpu"].map(gpus.index), _k=d["kernel"].map(_kernel_rank), _s=d["scheme"].map(_scheme_rank))
    d = d.sort_values(["_g", "_s", "_k"])
    return pd.DataFrame({
        "GPU": d["gpu_label"],
        "Kernel": d["kernel"].map(lambda k: KERNEL_LABELS.get(k, k)),
        "Scheme": d["scheme"],
        "Latency (ms)": d["time_ms"],
        "vs cuBLAS": d["speedup"],
        "Max rel. err": d["max_rel_err"],
        "GB/s": d["gbps"],
    }).reset_index(drop=True)


def layer_table(df: pd.DataFrame, kernel: str = "lut", scheme: str = FOUR_BIT) -> pd.DataFrame:
    """Speedup vs torch fp16 by layer shape: ours per GPU, beside the seed's RTX 4090 numbers."""
    d = _timed(df)
    ours = d[(d["kernel"] == kernel) & (d["scheme"] == scheme) & (d["batch"] == 1)]
    layer_shapes = set(ours.loc[ours["grid"] == "layers", "shape"])
    seed_order = list(SEED_004["layers"])
    shapes = sorted(layer_shapes | set(seed_order),
                    key=lambda s: (s[0] * s[1], seed_order.index(s) if s in seed_order else len(seed_order), s))
    out = pd.DataFrame({
        "Layer (in x out)": [shape_label(s) for s in shapes],
        "Role": [LAYER_ROLES.get(s, "") for s in shapes],
    })
    for gpu in _gpus(d):
        g = ours[ours["gpu"] == gpu].drop_duplicates("shape").set_index("shape")["speedup"]
        out[f"Speedup vs torch fp16, {MEASURED} ({gpu_label(gpu)})"] = [g.get(s, np.nan) for s in shapes]
    out[f"Speedup vs {SEED_004['layers_baseline']}, {SEED} ({SEED_004['layers_gpu']})"] = [
        SEED_004["layers"].get(s, np.nan) for s in shapes
    ]
    return out


def largest_shape(d: pd.DataFrame) -> tuple[int, int]:
    """The largest batch-1 weight (in x out) timed for the 4-bit kernel."""
    d = _timed(d) if "shape" not in d else d
    c = d[(d["scheme"] == FOUR_BIT) & (d["batch"] == 1)]
    if c.empty:
        raise ValueError("no batch-1 4-bit timing in the recorded data")
    return max(c["shape"], key=lambda s: (s[0] * s[1], s))


def bandwidth_law_points(df: pd.DataFrame, kernels=PRODUCT_KERNELS) -> pd.DataFrame:
    """Long form: one row per (source, GPU, kernel, scheme, shape) with bandwidth and speedup.

    Ours at 4096 x 4096 (the seed's shape) and at each GPU's largest shape, every scheme;
    ``ceiling`` is the byte ratio fp16 bytes / our bytes (the first factor of the law).
    The seed's rows (4-bit, 4096 x 4096) come from :data:`SEED_004`.
    """
    d = _timed(df)
    d["fp16_bytes"] = _baseline_bytes(d)
    rows = []
    seed_shape = SEED_004["bandwidth_law_shape"]
    for gpu in _gpus(d):
        g = d[(d["gpu"] == gpu) & (d["batch"] == 1) & d["kernel"].isin(kernels)]
        if g.empty:
            continue
        big = largest_shape(g)
        for which, shape in (("seed shape", seed_shape), ("largest shape", big)):
            for _, r in g[g["shape"] == shape].drop_duplicates(["kernel", "K"]).iterrows():
                rows.append({
                    "source": MEASURED, "gpu": gpu_label(gpu), "kernel": r["kernel"], "scheme": r["scheme"],
                    "which": which, "shape": shape, "bandwidth_tbps": r["copy_gbps"] / 1e3,
                    "bandwidth_basis": "copy bandwidth, measured here",
                    "speedup": r["speedup"], "ceiling": r["fp16_bytes"] / r["bytes"],
                })
    for s in SEED_004["bandwidth_law"]:
        rows.append({
            "source": SEED, "gpu": s["gpu"], "kernel": "seed 4-bit kernel", "scheme": FOUR_BIT,
            "which": "seed shape", "shape": seed_shape, "bandwidth_tbps": s["bandwidth_tbps"],
            "bandwidth_basis": "bandwidth class, reported by the seed", "speedup": s["speedup"], "ceiling": np.nan,
        })
    return pd.DataFrame(rows)


def bandwidth_law_table(df: pd.DataFrame, kernel: str = "lut") -> pd.DataFrame:
    """Speedup of the 4-bit kernel vs fp16 by GPU and bandwidth class: ours and the seed's rows.

    Two-level columns: the top level says whose numbers they are ("measured here" or "reported
    by the seed"). Our bandwidth is the copy bandwidth measured in the same run (bytes read +
    written); the seed's is the nominal class its report gives.
    """
    p = bandwidth_law_points(df)
    ours = p[(p["source"] == MEASURED) & (p["kernel"] == kernel) & (p["scheme"] == FOUR_BIT)]
    seed_shape = shape_label(SEED_004["bandwidth_law_shape"])
    bigs = {shape_label(s) for s in ours.loc[ours["which"] == "largest shape", "shape"]}
    big_col = f"speedup at {next(iter(bigs))}" if len(bigs) == 1 else "speedup at the largest shape"
    cols = [("", "GPU"), (MEASURED, "copy bandwidth (TB/s)"), (MEASURED, f"speedup at {seed_shape}"),
            (MEASURED, big_col)]
    if len(bigs) > 1:
        cols.append((MEASURED, "largest shape"))
    cols += [(SEED, "bandwidth class (TB/s)"), (SEED, f"speedup at {seed_shape}")]
    rows = []
    for gpu, g in ours.groupby("gpu", sort=False):
        at = g[g["which"] == "seed shape"]
        big = g[g["which"] == "largest shape"]
        row = {cols[0]: gpu, cols[1]: g["bandwidth_tbps"].iloc[0],
               cols[2]: at["speedup"].iloc[0] if len(at) else np.nan,
               cols[3]: big["speedup"].iloc[0] if len(big) else np.nan}
        if len(bigs) > 1:
            row[(MEASURED, "largest shape")] = shape_label(big["shape"].iloc[0]) if len(big) else ""
        rows.append(row)
    for _, s in p[p["source"] == SEED].iterrows():
        rows.append({cols[0]: f"{s['gpu']} (seed)", (SEED, "bandwidth class (TB/s)"): s["bandwidth_tbps"],
                     (SEED, f"speedup at {seed_shape}"): s["speedup"]})
    out = pd.DataFrame(rows, columns=pd.MultiIndex.from_tuples(cols))
    for c in cols:
        if "speedup" in c[1] or "TB/s" in c[1]:
            out[c] = out[c].astype(float)
    if len(bigs) > 1:
        out[(MEASURED, "largest shape")] = out[(MEASURED, "largest shape")].fillna("")
    return out


PROVENANCE_FIELDS = ("gpu", "driver", "cuda", "torch", "numba", "numba_cuda", "git_commit", "git_dirty", "date", "command")


def provenance_table(folder=None, transpose: bool = False) -> pd.DataFrame:
    """One row per recorded GPU: where its numbers came from (file, software, commit, command).

    ``transpose=True`` gives one column per GPU instead (narrower on a page).
    """
    root = _root(folder)
    files = _files(root)
    if not files:
        raise NoRecordedDataError(f"no {root}/<gpu>/{NAME}.json: no GPU has recorded the GEMV measurements")
    rows = []
    for path in files:
        prov, _ = results.read(path)
        row = {"file": f"{root.name}/{path.parent.name}/{path.name}"}
        row.update({k: prov.get(k) for k in PROVENANCE_FIELDS})
        copy = prov.get("copy_gbps")
        row["copy GB/s"] = round(float(copy)) if copy is not None else None
        rows.append(row)
    t = pd.DataFrame(rows)
    if transpose:
        labels = [gpu_label(g) for g in t["gpu"]]
        t = t.T.astype(str).replace({"None": "–", "nan": "–"})
        t.columns = labels
        t = t.rename_axis("field").reset_index()
    return t


def _flat(c) -> str:
    return " ".join(str(x) for x in c) if isinstance(c, tuple) else str(c)


def _plain_float(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1e4 else f"{v:.4g}"


def styled(table: pd.DataFrame, caption: str | None = None):
    """A display form of a table: fixed decimals, "x" on speedups, "–" for missing, no index.

    A GPU repeated on consecutive rows is shown once, at the first of them.
    """
    table = table.copy()
    gpu_cols = [c for c in table.columns if _flat(c).strip() == "GPU"]
    for c in gpu_cols:
        table.loc[table[c].eq(table[c].shift()), c] = ""
    fmt, numeric = {}, []
    for c in table.columns:
        if not pd.api.types.is_numeric_dtype(table[c]) or pd.api.types.is_bool_dtype(table[c]):
            continue
        numeric.append(c)
        lc = _flat(c).lower()
        if "speedup" in lc or lc.startswith("vs "):
            fmt[c] = "{:.2f}x"
        elif "err" in lc:
            fmt[c] = "{:.1e}"
        elif "(ms)" in lc:
            fmt[c] = "{:.4f}"
        elif "(us)" in lc or "(µs)" in lc:
            fmt[c] = "{:.1f}"
        elif " / floor" in lc:
            fmt[c] = "{:.2f}x"
        elif "tb/s" in lc:
            fmt[c] = "{:.2f}"
        elif "gb/s" in lc:
            fmt[c] = "{:.0f}"
        elif "tok/s" in lc or "(gb)" in lc:
            fmt[c] = "{:.1f}"
        elif "j/token" in lc or "share" in lc:
            fmt[c] = "{:.2f}"
        elif " / " in lc:  # a ratio of two measurements ("numba / C++", "tried / committed")
            fmt[c] = "{:.2f}x"
        elif pd.api.types.is_float_dtype(table[c]):  # anything else: 4 significant digits, not pandas' 6 decimals
            fmt[c] = _plain_float
    s = table.style.format(fmt, na_rep="–").hide(axis="index")
    s = s.set_table_styles([
        {"selector": "", "props": [("font-size", "0.88em")]},
        {"selector": "th", "props": [("text-align", "left"), ("vertical-align", "bottom")]},
        {"selector": "th.col_heading.level0", "props": [("text-align", "center")]},
        {"selector": "td", "props": [("vertical-align", "top")]},
    ])
    if numeric:
        s = s.set_properties(subset=numeric, **{"white-space": "nowrap", "text-align": "right"})
    short = [c for c in table.columns if c not in numeric and table[c].astype(str).str.len().max() <= 14]
    if short:
        s = s.set_properties(subset=short, **{"white-space": "nowrap"})
    if caption:
        s = s.set_caption(caption)
    return s


# -- figures ---------------------------------------------------------------------------------
@contextmanager
def _style():
    import seaborn as sns

    with mpl.rc_context():
        sns.set_theme(context="notebook", style="whitegrid", font_scale=1.05)
        mpl.rcParams.update({"figure.dpi": 100, "savefig.dpi": 100, "legend.fontsize": 10, "axes.titlesize": 12,
                             "figure.titlesize": 14, "figure.titleweight": "bold"})
        yield


def _color(scheme, i=0) -> str:
    return _SCHEME_COLORS.get(scheme, f"C{(i + 4) % 10}")


# Colour says the scheme; these tell the kernels of one scheme apart (ours plain, the C++ counterparts
# hatched and dashed), since a scheme's kernels share its colour.
_KERNEL_HATCHES = {"lut": "", "cuda_cpp_4bit": "//", "cuda_cpp_4bit_mma": "..", "cuda_cpp_4bit_dual": "\\\\", "cuda_cpp_u8": "xx"}
_KERNEL_LINES = {"lut": ("-", "o"), "cuda_cpp_4bit": ("--", "D"), "cuda_cpp_4bit_mma": (":", "v"), "cuda_cpp_4bit_dual": (":", "s"),
                 "cuda_cpp_u8": ("-.", "P")}


def _shared_legend(fig: Figure, axes, ncols: int) -> None:
    """One legend under the panels, each label once, whichever panel drew it first."""
    seen = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen.keys()), loc="outside lower center", ncols=ncols, frameon=False)


def fig_bandwidth_law(df: pd.DataFrame, kernels=PRODUCT_KERNELS) -> Figure:
    """Speedup vs fp16 against the GPU's bandwidth: ours (filled) and the seed's (hollow)."""
    p = bandwidth_law_points(df, kernels)
    ours, seed = p[p["source"] == MEASURED], p[p["source"] == SEED]
    with _style():
        fig = Figure(figsize=(11, 6.0), layout="constrained")
        axes = list(fig.subplots(1, 2, sharey=True))
        big_shapes = sorted({shape_label(s) for s in ours.loc[ours["which"] == "largest shape", "shape"]})
        titles = {
            "seed shape": f"at {shape_label(SEED_004['bandwidth_law_shape'])}, the seed's shape",
            "largest shape": f"at the largest shape measured here ({', '.join(big_shapes) or 'none'})",
        }
        kernels_present = sorted(ours["kernel"].unique(), key=_kernel_rank)
        for ax, which in zip(axes, ("seed shape", "largest shape")):
            o = ours[ours["which"] == which]
            for (kern, scheme), g in o.groupby(["kernel", "scheme"], sort=False):
                ax.scatter(g["bandwidth_tbps"], g["speedup"], s=80, color=_color(scheme),
                           marker=_MARKERS[kernels_present.index(kern) % len(_MARKERS)],
                           edgecolor="black", linewidth=0.6, zorder=3)
                # the byte-ratio ceiling of this scheme at this shape
                ax.scatter(g["bandwidth_tbps"], g["ceiling"], s=300, marker="_", linewidth=2.5,
                           color=_color(scheme), zorder=2)
            for gpu, g in o.groupby("gpu"):
                # our GPUs are named along the top of the panel, away from the points
                x = g["bandwidth_tbps"].iloc[0]
                ax.axvline(x, color="#999999", linewidth=0.8, linestyle="-", zorder=1)
                ax.annotate(gpu, (x, 1.0), xycoords=("data", "axes fraction"), textcoords="offset points",
                            xytext=(-3, -5), ha="right", va="top", rotation=90, fontsize=9, fontweight="bold",
                            bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})
            if which == "seed shape":
                ax.scatter(seed["bandwidth_tbps"], seed["speedup"], s=90, facecolor="none",
                           edgecolor=_color(FOUR_BIT), linewidth=1.8, zorder=3)
                xs = seed["bandwidth_tbps"].to_numpy()
                for _, r in seed.iterrows():
                    # a label goes left of its point when another seed point sits just to its right
                    left = bool(((xs > r["bandwidth_tbps"]) & (xs - r["bandwidth_tbps"] < 0.6)).any())
                    ax.annotate(r["gpu"], (r["bandwidth_tbps"], r["speedup"]), textcoords="offset points",
                                xytext=(-9 if left else 9, 0), ha="right" if left else "left", va="center",
                                fontsize=9, color="#333333", fontstyle="italic")
            ax.axhline(1.0, color="black", linewidth=1, linestyle=":")
            ax.set_title(titles[which])
            ax.set_xlabel("Memory bandwidth (TB/s)\nours: copy bandwidth, measured; seed: nominal class")
        axes[0].set_ylabel("Speedup vs fp16 (x, higher is faster)")
        axes[1].tick_params(labelleft=True)
        xmax = max(p["bandwidth_tbps"].max() * 1.3, 1.0)
        for ax in axes:
            ax.set_xlim(0, xmax)
        ally = pd.concat([p["speedup"], p["ceiling"]]).dropna()
        axes[0].set_ylim(0, max(ally.max() * 1.25, 1.2))
        handles = [Line2D([], [], color=_color(s), marker="o", linestyle="none", markersize=8,
                          markeredgecolor="black", label=f"{s}, {MEASURED}")
                   for s in sorted(ours["scheme"].unique(), key=_scheme_rank)]
        if len(kernels_present) > 1:
            handles += [Line2D([], [], color="gray", marker=_MARKERS[i % len(_MARKERS)], linestyle="none",
                               markersize=8, label=f"kernel {k}") for i, k in enumerate(kernels_present)]
        handles += [
            Line2D([], [], color=_color(FOUR_BIT), marker="o", markerfacecolor="none", linestyle="none",
                   markersize=8, markeredgewidth=1.8, label=f"{FOUR_BIT}, {SEED}"),
            Line2D([], [], color="gray", marker="_", linestyle="none", markersize=16, markeredgewidth=2.5,
                   label="ceiling: fp16 bytes / our bytes"),
            Line2D([], [], color="black", linestyle=":", label="parity with fp16"),
        ]
        fig.legend(handles=handles, loc="outside lower center", ncols=3, frameon=False)
        fig.suptitle("The bandwidth law: speedup over fp16 against memory bandwidth (batch 1)")
    return fig


def fig_roofline(df: pd.DataFrame, kernels=("torch fp16",) + PRODUCT_KERNELS) -> Figure:
    """Achieved GB/s against bytes moved, per GPU, with the GPU's measured copy bandwidth."""
    d = _timed(df)
    d = d[(d["batch"] == 1) & d["kernel"].isin(kernels)].drop_duplicates(["gpu", "kernel", "K", "shape"])
    gpus = _gpus(d)
    with _style():
        fig = Figure(figsize=(max(8.0, 5.0 * len(gpus)), 5.4), layout="constrained")
        axes = list(fig.subplots(1, len(gpus), sharey=True, squeeze=False)[0])
        for ax, gpu in zip(axes, gpus):
            g = d[d["gpu"] == gpu]
            keys = sorted({(k, s) for k, s in zip(g["kernel"], g["scheme"])}, key=lambda t: (_scheme_rank(t[1]), _kernel_rank(t[0])))
            for i, (kern, scheme) in enumerate(keys):
                s = g[(g["kernel"] == kern) & (g["scheme"] == scheme)].sort_values("bytes")
                ax.plot(s["bytes"] / 1e6, s["gbps"], marker=_MARKERS[i % len(_MARKERS)], color=_color(scheme, i),
                        linestyle="none", markersize=8, markeredgecolor="black", markeredgewidth=0.5,
                        label=series_label(kern, scheme))
            copy = g["copy_gbps"].dropna()
            if len(copy):
                ax.axhline(copy.iloc[0], color="crimson", linewidth=1.5,
                           label=f"copy bandwidth of the GPU, {MEASURED} (read + write)")
                ax.annotate(f"copy {copy.iloc[0]:.0f} GB/s", (0.02, copy.iloc[0]), xycoords=("axes fraction", "data"),
                            textcoords="offset points", xytext=(0, 4), color="crimson", fontsize=9)
            ax.set_xscale("log")
            ax.set_title(gpu_label(gpu))
            ax.set_xlabel("Bytes moved per call: weights + x + y (MB, log scale)")
        axes[0].set_ylabel("Achieved bandwidth (GB/s)")
        axes[0].set_ylim(bottom=0)
        _shared_legend(fig, axes, ncols=3)
        fig.suptitle("Achieved bandwidth of each kernel against bytes moved (batch 1, every timed shape)")
    return fig


def speedup_by_shape(df: pd.DataFrame, kernels=PRODUCT_KERNELS, grids=("layers", "bandwidth", "table")) -> pd.DataFrame:
    """Long form behind :func:`fig_speedup_by_shape`: speedup and byte-ratio ceiling per shape."""
    d = _timed(df)
    d["fp16_bytes"] = _baseline_bytes(d)
    d = d[(d["batch"] == 1) & d["kernel"].isin(kernels) & d["grid"].isin(grids)]
    d = d.drop_duplicates(["gpu", "kernel", "K", "shape"])
    d["ceiling"] = d["fp16_bytes"] / d["bytes"]
    return d


def fig_speedup_by_shape(df: pd.DataFrame, kernels=PRODUCT_KERNELS) -> Figure:
    """Speedup vs torch fp16 per shape and scheme (bars) with the byte-ratio ceiling (dashes)."""
    d = speedup_by_shape(df, kernels)
    gpus = _gpus(d)
    with _style():
        fig = Figure(figsize=(10, 4.2 * len(gpus) + 0.6), layout="constrained")
        axes = fig.subplots(len(gpus), 1, squeeze=False)[:, 0]
        for ax, gpu in zip(axes, gpus):
            g = d[d["gpu"] == gpu]
            shapes = sorted(g["shape"].unique(), key=lambda s: (s[0] * s[1], s))
            series = sorted({(k, s) for k, s in zip(g["kernel"], g["scheme"])}, key=lambda t: (_scheme_rank(t[1]), _kernel_rank(t[0])))
            width = 0.8 / max(len(series), 1)
            for i, (kern, scheme) in enumerate(series):
                s = g[(g["kernel"] == kern) & (g["scheme"] == scheme)].set_index("shape")
                xs = np.array([j for j, sh in enumerate(shapes) if sh in s.index]) + (i - (len(series) - 1) / 2) * width
                here = [sh for sh in shapes if sh in s.index]
                color = _color(scheme, i)
                ax.bar(xs, s.loc[here, "speedup"], width=width * 0.92, color=color, label=series_label(kern, scheme),
                       hatch=_KERNEL_HATCHES.get(kern, ""), edgecolor="white", linewidth=0.5)
                ax.hlines(s.loc[here, "ceiling"], xs - width * 0.46, xs + width * 0.46, colors=color,
                          linestyles="--", linewidth=2)
            ax.axhline(1.0, color="black", linewidth=1, linestyle=":")
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels([f"{a} x {b}" + (f"\n{LAYER_ROLES[(a, b)]}" if (a, b) in LAYER_ROLES else "") for a, b in shapes],
                               fontsize=9)
            ax.set_xlabel("Weight shape (in_features x out_features), smallest to largest")
            ax.set_ylabel("Speedup vs torch fp16 (x)")
            ax.set_title(f"{gpu_label(gpu)}: batch 1, {MEASURED}")
            ax.plot([], [], color="gray", linestyle="--", linewidth=2, label="ceiling: fp16 bytes / our bytes")
            ax.plot([], [], color="black", linestyle=":", label="parity with fp16")
            top = np.nanmax(np.r_[g["ceiling"].to_numpy(), g["speedup"].to_numpy(), 1.0])
            ax.set_ylim(0, top * 1.1)
        _shared_legend(fig, axes, ncols=3)  # below the panels: inside, it covered the small shapes' ceilings
        fig.suptitle("Speedup over fp16 by weight shape, against the byte-ratio ceiling")
    return fig


def floor_table(df: pd.DataFrame) -> pd.DataFrame:
    """What bounds the 4-bit kernel at batch 1, per GPU and shape, from runs that recorded the floors.

    Columns (times in microseconds): torch fp16; our tuned 4-bit kernel (weights rotated past L2);
    the same launch with one copy of the weight, which then stays in L2 (blank where it does not
    fit in three quarters of it); the streaming floor, a kernel that only reads the same code bytes;
    an empty launch; "ours / floor"; and "fp16 / floor", the speedup a kernel reaching the floor
    would have. Raises ValueError where no run recorded the floors.
    """
    d = _normalise(df)
    fl = d[(d["grid"] == FLOOR_GRID) & d["time_ms"].notna()]
    if fl.empty:
        raise ValueError("no recorded GEMV run has the streaming floors (`trapetum gemv` records them since session 18)")
    ours = _timed(d)
    ours = ours[(ours["kernel"] == "lut") & (ours["scheme"] == FOUR_BIT) & (ours["batch"] == 1)]
    ours = ours.drop_duplicates(["gpu", "in_features", "out_features"])
    key = ["gpu", "in_features", "out_features"]
    m = fl[key + ["time_ms", "fp16_ms", "empty_launch_ms"]].merge(ours[key + ["time_ms", "l2_resident_ms"]], on=key, how="inner",
                                                                   suffixes=("_floor", ""))
    gpus = _gpus(d[d["gpu"].isin(m["gpu"])])
    m = m.assign(_g=m["gpu"].map(gpus.index), _n=m["in_features"] * m["out_features"]).sort_values(["_g", "_n", "in_features"])
    return pd.DataFrame({
        "GPU": m["gpu"].map(gpu_label),
        "Shape": [shape_label(s) for s in zip(m["in_features"], m["out_features"])],
        "torch fp16 (us)": m["fp16_ms"] * 1e3,
        "4-bit kernel (us)": m["time_ms"] * 1e3,
        "weight in L2 (us)": m["l2_resident_ms"].astype(float) * 1e3,
        "stream floor (us)": m["time_ms_floor"] * 1e3,
        "empty launch (us)": m["empty_launch_ms"] * 1e3,
        "ours / floor": m["time_ms"] / m["time_ms_floor"],
        "fp16 / floor": m["fp16_ms"] / m["time_ms_floor"],
    }).reset_index(drop=True)


def fig_floor(df: pd.DataFrame) -> Figure:
    """Speedup over fp16 of the 4-bit kernel by shape, beside the speedup of the streaming floor."""
    t = floor_table(df)
    gpus = list(dict.fromkeys(t["GPU"]))
    with _style():
        fig = Figure(figsize=(10, 3.8 * len(gpus) + 0.6), layout="constrained")
        axes = fig.subplots(len(gpus), 1, squeeze=False)[:, 0]
        for ax, gpu in zip(axes, gpus):
            g = t[t["GPU"] == gpu].reset_index(drop=True)
            xs = np.arange(len(g))
            ours = g["torch fp16 (us)"] / g["4-bit kernel (us)"]
            ax.bar(xs - 0.2, ours, width=0.38, color=_color(FOUR_BIT, 0), label="our 4-bit kernel (tuned)")
            ax.bar(xs + 0.2, g["fp16 / floor"], width=0.38, color="#bbbbbb", label="a kernel that only reads the 4-bit bytes")
            ax.axhline(1.0, color="black", linewidth=1, linestyle=":")
            ax.set_xticks(xs)
            ax.set_xticklabels(g["Shape"], fontsize=9)
            ax.set_xlabel("Weight shape (in_features x out_features), smallest to largest")
            ax.set_ylabel("Speedup vs torch fp16 (x)")
            ax.set_title(f"{gpu}: batch 1, {MEASURED}")
            ax.legend(loc="upper left", frameon=True)
        fig.suptitle("The 4-bit kernel against the streaming floor of its own bytes")
    return fig


def _target_value(v, unit: str = "x") -> str:
    """A targets table's value: a ratio as "2.50x" (unit "x"), a share as "85 %" ("%"), a count as "114"
    ("n"); "–" where there is none."""
    if pd.isna(v):
        return "–"
    return {"x": f"{v:.2f}x", "%": f"{100 * v:.0f} %", "n": f"{int(v)}"}[unit]


def _target_met(ours, goal, at_most: bool = False) -> str:
    """A targets table's verdict: "yes", "no", or "–" where nothing was measured."""
    if pd.isna(ours):
        return "–"
    return "yes" if (ours <= goal if at_most else ours >= goal) else "no"


# Issue 2's speed targets (H100, ratios against torch fp16 in the same run): (measure, goal, unit).
GEMV_TARGETS = (
    ("4-bit, batch 1: min speedup at in x out >= 4096 x 14336", 3.3, "x"),
    ("4-bit, batch 1: speedup at 4096 x 4096", 2.0, "x"),
    ("4-bit, batch 1: min share of the copy bandwidth at in x out >= 4096 x 14336", 0.85, "%"),
    ("uint8 K=64, batch 1: min speedup at in x out >= 4096 x 14336", 1.7, "x"),
    ("uint8 K=256, batch 1: min speedup at in x out >= 4096 x 14336", 1.7, "x"),
    ("4-bit, batch 8: speedup at 4096 x 14336", 2.5, "x"),
    ("4-bit, batches 2..64: min speedup at 4096 x 14336", 1.0, "x"),
)
LARGE = 4096 * 14336  # in x out of the "large shapes" of issue 2's targets


def gemv_targets(df: pd.DataFrame) -> pd.DataFrame:
    """Issue 2's speed targets per GPU with recorded floors: the goal, ours, and the ceiling beside it.

    The ceiling is what a kernel that only reads the same code bytes would reach (the streaming floor of
    :func:`floor_table`, timed at batch 1; the same codes are read at every batch, so a batch-b row
    divides fp16 at batch b by it). The floors time 4-bit codes only, so the uint8 rows give the
    byte ratio instead (fp16 bytes over ours, codebooks counted): higher than any measured floor,
    since it assumes reading ours at cuBLAS's efficiency. "ours" is the tuned path a ``QLinear``
    takes (the fused kernels). Empty where no run recorded floors."""
    d = _normalise(df)
    fl = d[(d["grid"] == FLOOR_GRID) & d["time_ms"].notna()]
    t = _timed(df)
    t["fp16_bytes"] = _baseline_bytes(t)
    ours = t[(t["kernel"] == "lut") & t["grid"].isin(("layers", "bandwidth", "table", "batch"))]
    ours = ours.drop_duplicates(["gpu", "scheme", "batch", "in_features", "out_features"])
    rows = []
    for gpu in _gpus(d[d["gpu"].isin(fl["gpu"])]):
        f = fl[fl["gpu"] == gpu].set_index(["in_features", "out_features"])
        o = ours[ours["gpu"] == gpu]
        big = o["in_features"] * o["out_features"] >= LARGE

        def at(scheme, batch, shape=None, large=False):
            m = o[(o["scheme"] == scheme) & (o["batch"] == batch)]
            if shape is not None:
                m = m[(m["in_features"] == shape[0]) & (m["out_features"] == shape[1])]
            return m[big[m.index]] if large else m

        def ceiling_of(m):  # min over m's records of fp16 at the record's batch / the floor of its shape
            floor = np.array([f["time_ms"].get(k, np.nan) for k in zip(m["in_features"], m["out_features"])], float)
            return np.nanmin(m["fp16_ms"].to_numpy(float) / floor) if len(m) and not np.isnan(floor).all() else np.nan

        b1 = at(FOUR_BIT, 1, large=True)
        sq = at(FOUR_BIT, 1, (4096, 4096))
        b8 = at(FOUR_BIT, 8, (4096, 14336))
        bs = o[(o["scheme"] == FOUR_BIT) & o["batch"].between(2, 64) & (o["in_features"] == 4096) & (o["out_features"] == 14336)]
        fgb = f[[i * o >= LARGE for i, o in f.index]]
        vals = [
            (b1["speedup"].min(), ceiling_of(b1), "stream floor", len(b1)),
            (sq["speedup"].min(), ceiling_of(sq), "stream floor", len(sq)),
            ((b1["gbps"] / b1["copy_gbps"]).min(), (fgb["gbps"] / fgb["copy_gbps"]).min() if len(fgb) else np.nan, "stream floor", len(b1)),
        ]
        for scheme in ("uint8 K=64", "uint8 K=256"):
            u = at(scheme, 1, large=True)
            vals.append((u["speedup"].min(), (u["fp16_bytes"] / u["bytes"]).min(), "byte ratio", len(u)))
        vals.append((b8["speedup"].min(), ceiling_of(b8), "stream floor", len(b8)))
        vals.append((bs["speedup"].min(), ceiling_of(bs), "stream floor", len(bs)))
        for (what, goal, unit), (mine, ceiling, basis, n) in zip(GEMV_TARGETS, vals):
            rows.append({"GPU": gpu_label(gpu), "target (issue 2)": what, "goal": _target_value(goal, unit), "records": n,
                         "ours": _target_value(mine, unit), "ceiling": _target_value(ceiling, unit), "ceiling from": basis,
                         "met": _target_met(mine, goal)})
    return pd.DataFrame(rows)


def fp16_share_note(df: pd.DataFrame, shape=(4096, 4096), large=(4096, 14336)) -> str:
    """One line for scale beside the bandwidth-share target: how much of the copy bandwidth torch fp16 (cuBLAS) itself
    reaches at batch 1 reading ``shape``'s weight, the recorded shape whose fp16 bytes are nearest the 4-bit codes of
    ``large`` (the smallest shape the target covers), per GPU. Empty without such records."""
    t = _timed(df)
    t = t[(t["kernel"] == "torch fp16") & (t["batch"] == 1) & (t["in_features"] == shape[0]) & (t["out_features"] == shape[1])
          & t["copy_gbps"].notna()]
    if t.empty:
        return ""
    parts = [f"{g['gbps'].median() / g['copy_gbps'].median():.0%} on the {gpu_label(gpu)}" for gpu, g in t.groupby("gpu")]
    mb_fp16, mb_4bit = 2 * shape[0] * shape[1] / 1e6, large[0] * large[1] / 2 / 1e6
    return (f"For scale: reading the {mb_fp16:.1f} MB of a {shape_label(shape)} weight at batch 1, torch fp16 (cuBLAS) reaches "
            f"{' and '.join(parts)} of the measured copy bandwidth (median of the recorded runs); the 4-bit codes of "
            f"{shape_label(large)}, the smallest shape the bandwidth-share target covers, are {mb_4bit:.1f} MB.")


def slower_intervals(g: pd.DataFrame) -> list[tuple[float, float | None]]:
    """Batch ranges where our time exceeds fp16's; ends log-interpolated, None = to the last batch."""
    g = g.sort_values("batch")
    b, s = g["batch"].to_numpy(float), g["speedup"].to_numpy(float)
    out, start = [], (b[0] if len(b) and s[0] < 1 else None)

    def cross(i):
        l0, l1, y0, y1 = math.log2(b[i - 1]), math.log2(b[i]), math.log(s[i - 1]), math.log(s[i])
        return 2 ** (l0 - y0 * (l1 - l0) / (y1 - y0))

    for i in range(1, len(b)):
        if s[i - 1] >= 1 > s[i]:
            start = cross(i)
        elif s[i - 1] < 1 <= s[i]:
            out.append((start, cross(i)))
            start = None
    if start is not None:
        out.append((start, None))
    return out


FAMILY_LABELS = {"lut": "FMA table (lut-fma)", "mma": "tensor cores, diagonal (mma)", "dual": "tensor cores, weights as A, diagonal x (dual)", "wide": "tensor cores, x as A (wide)",
                 "tile": "tensor cores, weights as A (tile)"}


def plan_label(r) -> str:
    """A fused record's launch plan in a few words: warps a block, K-slices and, where blocks walk
    several groups of rows (the wide and tile kernels), how many each; '' for records without a plan."""
    def num(k):
        v = r.get(k)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)

    warps, ks, walk = num("warps"), num("ksplit"), num("walk")
    if warps is None:
        return ""
    return f"{warps} warps, {ks} K-slice{'s' if ks != 1 else ''}" + (f", {walk} row groups a block" if walk and walk > 1 else "")


# The tile kernel's changes tried and reverted (their code is in git history): probe pattern -> (what changed,
# the record fields of the kernel as committed and of the tried one, both timed in the probe's process)
TILE_TRIALS = {
    "_runs/tile-ring-*.json": ("x streamed through a ring of cp.async slots, one barrier a turn",
                                "staged_us", "ring_best_us", "ring_best_plan"),
    "_runs/tile-red-finish-*.json": ("K-slices added up by L2 reductions, the last block only converting",
                                     "old_us", "new_best_us", "new_best_plan"),
}


def tile_trials(folder=None) -> pd.DataFrame:
    """The tile kernel's changes that lost (session 39), one row a probe, GPU, shape and batch: torch fp16,
    the kernel as committed at its recorded plan, and the tried change at its fastest plan, all timed in
    the probe's process; "tried / committed" above 1 is slower."""
    rows = []
    for pattern, (change, base, tried, plan) in TILE_TRIALS.items():
        for prov, probe, t in _probe_runs(folder, pattern, short=True):
            for r in t.to_dict("records"):
                rows.append({"change": change, "probe": probe, "GPU": gpu_label(prov.get("gpu", "")),
                             "in x out": shape_label((int(r["n_in"]), int(r["n_out"]))), "batch": int(r["batch"]),
                             "torch fp16 (us)": float(r["fp16_us"]), "committed (us)": float(r[base]),
                             "tried, fastest plan (us)": float(r[tried]), "tried plan": str(r[plan]),
                             "tried / committed": float(r[tried]) / float(r[base])})
    return pd.DataFrame(rows)


def batch_table(df: pd.DataFrame) -> pd.DataFrame:
    """The batch sweep per GPU: each path's time against torch fp16 in the same run, and for the
    fused rows the kernel family the tuner picked at that batch."""
    d = _timed(df)
    d = d[(d["grid"] == "batch") & d["kernel"].isin(("lut", "dequant+cublas"))]
    if d.empty:
        raise ValueError("no 'batch' grid in the recorded data")
    fam = d["plan_kernel"] if "plan_kernel" in d else pd.Series(np.nan, index=d.index)
    path = np.where(d["kernel"] == "dequant+cublas", "dequantize + cuBLAS",
                    "fused: " + fam.map(lambda k: FAMILY_LABELS.get(k, "lut")).astype(str))
    d = d.assign(_path=path, _plan=d.apply(plan_label, axis=1), _g=d["gpu"].map(_gpus(d).index)).sort_values(["_g", "batch", "_path"])
    return pd.DataFrame({
        "GPU": d["gpu_label"], "Shape": d["shape"].map(shape_label), "Batch": d["batch"].astype(int), "Path": d["_path"],
        "Plan": d["_plan"],
        "Time (µs)": d["time_ms"] * 1e3, "torch fp16 (µs)": d["fp16_ms"] * 1e3, "vs fp16": d["speedup"],
        "Max rel. err": d["max_rel_err"],
    }).reset_index(drop=True)


def fig_batch(df: pd.DataFrame) -> Figure:
    """Time per call against batch size: torch fp16, our fused kernel, and dequant+cuBLAS."""
    d = _timed(df)
    d = d[d["grid"] == "batch"]
    if d.empty:
        raise ValueError("no 'batch' grid in the recorded data")
    gpus = _gpus(d)
    with _style():
        fig = Figure(figsize=(max(8.0, 5.0 * len(gpus)), 5.6), layout="constrained")
        axes = list(fig.subplots(1, len(gpus), squeeze=False)[0])
        for ax, gpu in zip(axes, gpus):
            g = d[d["gpu"] == gpu].sort_values("batch")
            shape = g["shape"].iloc[0]
            fp16 = g.drop_duplicates("batch")
            ax.plot(fp16["batch"], fp16["fp16_ms"] * 1e3, marker="s", color=_color("dense fp16"), label="torch fp16 (cuBLAS)")
            for i, (kern, s) in enumerate(g.groupby("kernel", sort=False)):
                label = f"{kern}, {s['scheme'].iloc[0]}" + (" (fused)" if kern != "dequant+cublas" else "")
                ls, marker = _KERNEL_LINES.get(kern, ("-", "^"))
                ax.plot(s["batch"], s["time_ms"] * 1e3, marker=marker, linestyle=ls,
                        color=_color(FOUR_BIT) if kern != "dequant+cublas" else "#9467bd", label=label)
            fused = g[g["kernel"] != "dequant+cublas"]["batch"]
            deq = g[g["kernel"] == "dequant+cublas"]["batch"]
            if len(fused) and len(deq) and fused.max() < deq.min():
                edge = math.sqrt(fused.max() * deq.min())
                ax.axvline(edge, color="#9467bd", linestyle=":", linewidth=1.2,
                           label=f"dispatch: fused up to batch {fused.max()}, dequant+cuBLAS above")
            # the path QLinear takes: fused wherever a fused kernel was timed
            ours = pd.concat([g[g["kernel"] != "dequant+cublas"], g[g["kernel"] == "dequant+cublas"]]).drop_duplicates("batch")
            for j, (lo, hi) in enumerate(slower_intervals(ours)):
                ax.axvspan(lo, hi if hi is not None else ours["batch"].max() * 1.2, color="gray", alpha=0.12, lw=0,
                           label="torch fp16 faster than ours" if j == 0 else None)
                if lo > ours["batch"].min():
                    ax.annotate(f"crossover\n~batch {lo:.1f}", (lo, 0.03), xycoords=("data", "axes fraction"),
                                textcoords="offset points", xytext=(4, 0), fontsize=9, color="#333333")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(mpl.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(mpl.ticker.FuncFormatter(lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "2356" else ""))
            ax.set_xticks(sorted(g["batch"].unique()))
            ax.set_xticklabels([str(int(b)) for b in sorted(g["batch"].unique())])
            ax.set_xlim(g["batch"].min() / 1.2, g["batch"].max() * 1.2)
            ax.set_xlabel("Batch size (activation rows, log scale)")
            ax.set_ylabel("Time per call (µs, log scale)")
            ax.set_title(f"{gpu_label(gpu)}\n{shape_label(shape)}, {FOUR_BIT}")
        _shared_legend(fig, axes, ncols=2)
        fig.suptitle("Beyond batch 1: time per call as the batch grows")
    return fig


# -- measuring -------------------------------------------------------------------------------
def papermill_command(**params) -> str:
    """How a papermill run of the chapter with these parameters is written on a command line."""
    parts = ["papermill notebooks/gemv.ipynb OUTPUT.ipynb"]
    for k, v in params.items():
        if isinstance(v, (list, tuple)):
            parts.append(f"-y '{k}: {list(v)}'")
        else:
            parts.append(f"-p {k} {v}")
    return " ".join(parts)


def measure_argv(out=None, arch: str = "sm_90", in_features=(), out_features=(), iterations: int | None = None,
                 run_cuda_cpp: bool = True, command: str | None = None) -> list[str]:
    """The ``trapetum gemv`` command line that the notebook's parameters stand for."""
    if len(in_features) != len(out_features):
        raise ValueError(f"in_features and out_features pair up into shapes: got {len(in_features)} and {len(out_features)}")
    argv = ["gemv", "--arch", str(arch)]
    if out is not None:
        argv += ["--out", str(out)]
    if len(in_features):
        argv += ["--in-features", *map(str, in_features), "--out-features", *map(str, out_features)]
    if iterations is not None:
        argv += ["--iterations", str(int(iterations))]
    argv.append("--cuda-cpp" if run_cuda_cpp else "--no-cuda-cpp")
    if command is not None:
        argv += ["--command", command]
    return argv


def numba_vs_cuda_cpp(df: pd.DataFrame, scheme: str = FOUR_BIT) -> pd.DataFrame:
    """Batch-1 times of the numba kernel (the tuner's pick) beside its CUDA C++ twin and the C++
    tensor-core kernels (mma; dual, in runs that have it: the numba pick at the large shapes), per
    GPU and shape, all from one run; "numba / C++" above 1 means numba is slower."""
    cpp = {"lut": "cuda_cpp_4bit", "mma": "cuda_cpp_4bit_mma", "dual": "cuda_cpp_4bit_dual"}  # the C++ program's designs
    d = _timed(df)
    d = d[(d["batch"] == 1) & (d["scheme"] == scheme) & d["kernel"].isin(("lut", *cpp.values()))]
    rows = []
    for (gpu, shape), g in d.groupby(["gpu", "shape"], sort=False):
        t = g.drop_duplicates("kernel").set_index("kernel")
        if "lut" not in t.index or "cuda_cpp_4bit" not in t.index:
            continue
        row = {"GPU": gpu_label(gpu), "in x out": shape_label(shape), "torch fp16 (ms)": t.loc["lut", "fp16_ms"],
               "numba lut (ms)": t.loc["lut", "time_ms"]}
        row |= {f"C++ {v} (ms)": t["time_ms"].get(k, np.nan) for v, k in cpp.items()}
        row |= {f"numba / C++ {v}": row["numba lut (ms)"] / row[f"C++ {v} (ms)"] for v in cpp}
        rows.append(row)
    if not rows:
        raise ValueError("no shape has both the numba kernel and its CUDA C++ twin recorded")
    return pd.DataFrame(rows).sort_values(["GPU", "in x out"], key=lambda c: c.map(str)).reset_index(drop=True)


CPP_DUAL_RUNS = "_runs/cpp-dual-*.json"  # the C++ twin of dual run alone (the program only, no numba in the process)


def cpp_dual_runs(df: pd.DataFrame, folder=None) -> pd.DataFrame:
    """The C++ dual's batch-1 times from its runs on their own (``data/_runs/cpp-dual-*.json``, one
    column a commit, oldest first), beside numba's batch-1 pick in that GPU's recorded ``gemv.json``
    (``df``: :func:`load_gemv`), which ran in another process; "C++ / numba" takes the newest C++ run.
    Empty where no such run was recorded."""
    runs = {}
    for _, prov, recs in _probe_files(folder, CPP_DUAL_RUNS):
        commit = str(prov.get("git_commit"))[:7]
        for r in recs:
            if r.get("variant") == "dual" and r.get("batch") == 1 and r.get("passed"):
                key = (gpu_label(prov.get("gpu", "")), (int(r["in_features"]), int(r["out_features"])))
                runs.setdefault(key, {})[f"C++ dual at {commit} (us)"] = 1e3 * float(r["time_ms"])
    if not runs:
        return pd.DataFrame()
    d = _timed(df)
    numba = {(gpu_label(g), tuple(s)): 1e3 * float(t)
             for g, s, t in d[(d["kernel"] == "lut") & (d["batch"] == 1) & (d["scheme"] == FOUR_BIT)][["gpu", "shape", "time_ms"]].itertuples(index=False)}
    rows = []
    for (gpu, shape), cols in runs.items():
        row = {"GPU": gpu, "in x out": shape_label(shape), **cols, "numba pick, gemv.json (us)": numba.get((gpu, shape), np.nan)}
        row["newest C++ / numba"] = list(cols.values())[-1] / row["numba pick, gemv.json (us)"]
        rows.append(row)
    return pd.DataFrame(rows)


# -- the end-to-end chapter ------------------------------------------------------------------
DECODE = "decode"
SERIAL_STEP = "fused-step (serial)"  # a fused-step row launched strictly in sequence beside a programmatic one of its run
PATH_ORDER = ["naive", "eager", "graphed", "compiled", SERIAL_STEP, "fused-step"]
GRAPHED_PATHS = ("graphed", "compiled", SERIAL_STEP, "fused-step")


def _label_serial_steps(df: pd.DataFrame) -> pd.DataFrame:
    """A run that timed the fused step both ways (``bench --programmatic both``) keeps both rows: the
    one launched strictly in sequence becomes path :data:`SERIAL_STEP`. A run with only serial rows
    (a GPU before sm_90, or an older run) keeps "fused-step": that is how the step runs there."""
    if "programmatic" not in df or "file" not in df:
        return df
    step = df["path"].eq("fused-step")
    prog = df["programmatic"].astype(object)
    key = ["file", "model", "scheme", "fused"]
    both = df[step & prog.eq(True)].set_index(key).index
    serial = step & prog.eq(False) & pd.Series([k in both for k in zip(*(df[c] for c in key))], index=df.index)
    return df.assign(path=df["path"].where(~serial, SERIAL_STEP))


def _path_rank(path) -> int:
    """A path's place in PATH_ORDER (unknown paths last), for sorting rows slowest path first."""
    return PATH_ORDER.index(path) if path in PATH_ORDER else len(PATH_ORDER)


def load_decode(folder=None) -> pd.DataFrame:
    """Every recorded decode run as one DataFrame; raises if there is none.

    Unlike the GEMV chapter, runs of one GPU may cover different models and paths (a 7B run of
    every path, then a 13B + 70B run, then a run of the compiled path alone), so every
    ``decode*.json`` is read and, per GPU, model, scheme and path, the newest run wins. Each row
    keeps its own run's fp16 baseline and provenance (``file``).
    """
    root = _root(folder)
    df = _decode_runs(root)
    if not df.empty:
        newest = df.groupby(["gpu", "model", "scheme", "path", "fused"], dropna=False)["date"].transform("max")
        df = df[df["date"] == newest].reset_index(drop=True)
    if df.empty:
        raise NoRecordedDataError(
            f"no GPU has recorded the decode measurements: found no {root}/<gpu>/{DECODE}.json. "
            "Measure on a CUDA GPU with `trapetum bench --arch llama-2-7b`, then rebuild the book.")
    # The bandwidth bound needs the GPU's copy bandwidth, which the GEMV run of the same GPU measured.
    copy = results.load(NAME, root)
    if not copy.empty and "copy_gbps" in copy:
        df["copy_gbps"] = df["gpu"].map(copy.groupby("gpu")["copy_gbps"].max())
    return df


def _decode_runs(folder=None) -> pd.DataFrame:
    """Every recorded decode run, the ones kept aside too, each row with its own run's fp16 baselines
    (:func:`_baselines`), serial fused steps labelled (:func:`_label_serial_steps`) and its GPU's label; empty
    where none was recorded. :func:`load_decode` keeps the newest run of each row, the repeat and rotation
    tables read them all."""
    df = results.load(DECODE, _root(folder), every_run=True)
    if df.empty:
        return df
    # runs before trapetum.fuse existed have no "fused" field: their projections were separate
    df["fused"] = df["fused"].fillna(False).astype(bool) if "fused" in df else False
    df = _label_serial_steps(_baselines(df))
    df["gpu_label"] = df["gpu"].map(gpu_label)
    return df


def _fp16_of_run(d: pd.DataFrame, col: str) -> pd.Series:
    """Each row's fp16 value of ``col`` from the same run (file), model, path and fusion (NaN where that run had none)."""
    if "file" not in d:
        return pd.Series(np.nan, index=d.index)
    key = ["file", "model", "path", "fused"]
    fp16 = d[d["scheme"] == "fp16"].drop_duplicates(key).set_index(key)[col]
    return pd.Series([fp16.get(k, np.nan) for k in zip(*(d[c] for c in key))], index=d.index, dtype=float)


def _best_fp16_of_run(d: pd.DataFrame, col: str = "tok_s") -> pd.Series:
    """Each row's ``col`` of the fastest fp16 graphed path of the same run, model and fusion: a path
    that slows fp16 down (the fused step runs fp16 projections unfused) must not flatter a codebook row."""
    if "file" not in d:
        return pd.Series(np.nan, index=d.index)
    key = ["file", "model", "fused"]
    f = (d[(d["scheme"] == "fp16") & d["path"].isin(GRAPHED_PATHS) & d["tok_s"].notna()]
         .sort_values("tok_s").drop_duplicates(key, keep="last").set_index(key)[col])
    return pd.Series([f.get(k, np.nan) for k in zip(*(d[c] for c in key))], index=d.index, dtype=float)


def _baselines(d: pd.DataFrame) -> pd.DataFrame:
    """Each row's fp16 baselines from its own run, computed before newer runs replace that run's fp16
    rows (a later fp16-only rerun must not leave an older codebook row without its same-run fp16):
    ``best_fp16_tok_s`` / ``best_fp16_vram_gb`` (the fastest fp16 graphed path's) and
    ``fp16_path_vram_gb`` (fp16's peak on the row's own path)."""
    return d.assign(best_fp16_tok_s=_best_fp16_of_run(d), best_fp16_vram_gb=_best_fp16_of_run(d, "vram_gb"),
                    fp16_path_vram_gb=_fp16_of_run(d, "vram_gb"))


DECODE_CHECK = "decode-check"


def load_decode_checks(folder=None) -> pd.DataFrame:
    """The real-model checks (``python -m trapetum.decode check``): each graphed path's greedy tokens
    and logits against the eager path of the same quantized model, from every GPU's latest
    ``decode-check.json``. Empty where none was recorded."""
    df = results.load(DECODE_CHECK, _root(folder))
    if not df.empty:
        df["gpu_label"] = df["gpu"].map(gpu_label)
    return df


def decode_check_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per GPU, model, scheme and path: greedy tokens equal to eager's, the largest logit
    difference relative to the largest logit, and the verdict against the path's tolerance
    (``trapetum.decode.CHECK_TOL``, the check's default; a run may have applied another, kept in
    its record as ``tol``)."""
    from .decode import CHECK_TOL  # torch and transformers: only where this table is drawn

    if df.empty:  # a chapter rerun into a fresh results folder: say how to fill this table, don't stop the chapter
        return pd.DataFrame({"Real-model check": ["none recorded in this results folder: run `python -m trapetum.decode "
                                                  "check smollm2-135m --path graphed,compiled,fused-step --out <folder>`"]})
    d = df.sort_values(["gpu_label", "model", "scheme", "path"], key=lambda c: c.map(_path_rank) if c.name == "path" else c)
    tol = d["path"].map(CHECK_TOL).astype(float)
    return pd.DataFrame({
        "GPU": d["gpu_label"], "Model (real weights)": d["model"], "Scheme": d["scheme"], "Path vs eager": d["path"],
        "Greedy tokens equal": d["matching_prefix"].astype(int).astype(str) + " / " + d["tokens"].astype(int).astype(str),
        "Max logit diff (of the largest logit)": d["max_rel_logit_diff"].astype(float),
        "Tolerance": tol,
        "Passed": np.where((d["matching_prefix"] == d["tokens"]) & (d["max_rel_logit_diff"] <= tol), "yes", "no"),
        "Run": d["git_commit"],
    }).reset_index(drop=True)


FUSED_SUFFIX = ", fused q/k/v, gate/up"  # trapetum.fuse: one layer for each group


def decode_table(df: pd.DataFrame) -> pd.DataFrame:
    """Decode tok/s, peak VRAM and J/token per GPU, model, scheme and integration path.

    Random weights, real architecture; "vs fp16" divides by fp16's tok/s on the same graphed path (naive and eager rows: fp16 graphed) of the
    same run, "vs fastest fp16" by the fastest fp16 graphed path of that run; a row whose fp16 model did not fit says so instead of a number. "VRAM vs fp16": peak
    VRAM over the fp16 model's on the same path of the same run (where that run had no fp16 on the
    path, its fastest fp16 path's). Baselines come from each row's own run even where a newer run
    replaced that run's fp16 rows (:func:`load_decode`). "share of bandwidth
    bound": tok/s x weight bytes a token reads / the copy bandwidth of the same GPU's GEMV run.
    """
    d = df.copy()
    if "fp16_vram_gb" not in d:
        d["fp16_vram_gb"] = np.nan
    if "best_fp16_tok_s" not in d:  # a frame not from load_decode: its own rows are the runs
        d = _baselines(d)
    d["_p"] = d["path"].map(_path_rank)
    d = d.sort_values(["gpu_label", "model", "scheme", "fused", "_p"], key=lambda c: c.map(str) if c.dtype == object else c)
    oom = d.get("oom", pd.Series(False, index=d.index)).fillna(False).astype(bool)
    return pd.DataFrame({
        "GPU": d["gpu_label"], "Model (random weights)": d["model"], "Scheme": d["scheme"],
        "Path": (d["path"] + np.where(d["fused"], FUSED_SUFFIX, "")).where(~oom, d["path"] + " (out of memory)"),
        "tok/s": d["tok_s"], "vs fp16": d["tok_s"] / d["fp16_tok_s"], "vs fastest fp16": d["tok_s"] / d["best_fp16_tok_s"],
        "Peak VRAM (GB)": d["vram_gb"],
        "VRAM vs fp16": d["vram_gb"] / d["fp16_vram_gb"].fillna(d["fp16_path_vram_gb"]).fillna(d["best_fp16_vram_gb"]),
        "J/token": d["j_per_token"],
        "share of kernel bound": d.get("fraction_of_kernel_bound", np.nan),
        # the same over the kernels the row's path launches: the fused step's own (fused operations,
        # own plans); other graphed paths run the projections as the kernel bound times them. A
        # fused-step row without that bound (an older run, an additive scheme) keeps the fastest
        # plans' share, a lower bound on its own: its kernels are at best those plans'.
        "share of own kernel bound": d.get("fraction_of_step_bound", pd.Series(np.nan, index=d.index)).fillna(
            d.get("fraction_of_kernel_bound", pd.Series(np.nan, index=d.index))),
        # the weight bytes a token must read (projections at their bits, fp16 lm_head) at the
        # GPU's copy bandwidth: how close decode gets to what the memory allows
        "share of bandwidth bound": (d["tok_s"] * d["weight_bytes_per_token"] / (d["copy_gbps"] * 1e9)
                                     if {"weight_bytes_per_token", "copy_gbps"} <= set(d) else np.nan),
        "run (commit)": d.get("git_commit", pd.Series(None, index=d.index)).astype(str).str[:7],
    }).reset_index(drop=True)


# Issue 4's targets (H100, batch 1, 512 tokens, fp16 graphed in the same run): (measure, model, scheme prefix, kind, goal).
DECODE_TARGETS = (
    ("7B, 4-bit K=16: tok/s vs the fastest fp16", "llama-2-7b", "4-bit K=16", "speed", 2.3),
    ("7B, 2-bit additive: tok/s vs the fastest fp16", "llama-2-7b", "2-bit additive", "speed", 3.5),
    ("7B, 4-bit K=16: peak VRAM vs fp16", "llama-2-7b", "4-bit K=16", "vram", 0.30),
    ("13B, 4-bit K=16: tok/s vs the fastest fp16", "llama-2-13b", "4-bit K=16", "speed", 2.3),
    ("70B, 2-bit additive: share of the bandwidth bound", "llama-2-70b", "2-bit additive", "bandwidth", 0.60),
    ("7B, 4-bit K=16: the fastest graphed row's share of its own kernels' bound", "llama-2-7b", "4-bit K=16", "kernel", 0.85),
    ("13B, 4-bit K=16: the fastest graphed row's share of its own kernels' bound", "llama-2-13b", "4-bit K=16", "kernel", 0.85),
    ("7B, 2-bit additive: the fastest graphed row's share of its own kernels' bound", "llama-2-7b", "2-bit additive", "kernel", 0.85),
    ("70B, 2-bit additive: the fastest graphed row's share of its own kernels' bound", "llama-2-70b", "2-bit additive", "kernel", 0.85),
)


def decode_targets(df: pd.DataFrame, repeats: pd.DataFrame | None = None) -> pd.DataFrame:
    """Issue 4's targets per GPU: the best graphed row of each (any LM head, embedding and path; "row"
    names it) and, beside it, what the same row's kernels allow: the kernel bound (its projection and
    LM-head kernels timed alone, nothing else of the token) over the fastest fp16, or for the bandwidth
    row the kernel bound's share of the bandwidth bound. "–" where a GPU has no such row or no kernel
    bound was measured; VRAM has no such bound. The "kernel" rows take the fastest row (as the speed
    rows do, not the one closest to its bound) and give its tok/s over the bound of the kernels it
    launches (issue 4: "its own per-layer kernel times"): for a fused-step row its fused projection
    kernels at their own plans, whose fastest-plan bound is the decode table's "share of kernel bound";
    "–" where that row's bound was not measured. With ``repeats`` (:func:`decode_repeats`), a speed row whose
    run was repeated with the same sources also gives the spread of its ratio over those runs ("repeats")."""
    t = decode_table(df)
    t = t[~t["Path"].str.contains("out of memory") & ~t["Path"].str.startswith(("naive", "eager")) & t["tok/s"].notna()]
    rows = []
    for gpu in dict.fromkeys(t["GPU"]):
        for what, model, scheme, kind, goal in DECODE_TARGETS:
            m = t[(t["GPU"] == gpu) & (t["Model (random weights)"] == model) & t["Scheme"].str.startswith(scheme)]
            col = {"speed": "vs fastest fp16", "vram": "VRAM vs fp16", "bandwidth": "share of bandwidth bound",
                   "kernel": "share of own kernel bound"}[kind]
            pick = "tok/s" if kind == "kernel" else col  # the fastest row, with or without an fp16 beside it (70B on an H100)
            m = m[m[pick].notna()]
            if kind != "kernel":  # a kernel row is the fastest row even where its bound was not measured ("–"):
                m = m[m[col].notna()]  # an older, slower row's share would describe kernels it no longer runs
            best = None if m.empty else (m.loc[m[pick].idxmin()] if kind == "vram" else m.loc[m[pick].idxmax()])
            ours = np.nan if best is None else float(best[col])
            ceiling = (np.nan if best is None or kind in ("vram", "kernel")
                       else float(best[col]) / float(best["share of kernel bound"]))
            unit = "x" if kind == "speed" else "%"
            met = _target_met(ours, goal, at_most=kind == "vram")
            row = {"GPU": gpu, "target (issue 4)": what, "goal": ("at most " if kind == "vram" else "") + _target_value(goal, unit),
                   "ours": _target_value(ours, unit), "kernel bound": _target_value(ceiling, unit), "met": met,
                   "row": "–" if best is None else f"{best['Scheme']}; {best['Path']} ({best['run (commit)']})"}
            if repeats is not None:
                low, row["repeats"] = _repeat_spread(repeats, best) if kind == "speed" else (np.nan, "–")
                if met == "yes" and low < goal:  # the newest run meets it, a repeat of the same sources did not
                    row["met"] = "yes, not in every repeat"
            rows.append(row)
    return pd.DataFrame(rows)


def _repeat_spread(repeats: pd.DataFrame, best) -> tuple[float, str]:
    """(lowest ratio, "lowest-highest (n runs)") of the ``repeats`` row that holds ``best``'s run; (NaN, "–") where
    its run was not repeated."""
    if best is None or repeats.empty:
        return np.nan, "–"
    r = repeats[(repeats["GPU"] == best["GPU"]) & (repeats["Model (random weights)"] == best["Model (random weights)"])
                & (repeats["Scheme"] == best["Scheme"]) & (repeats["Path"] == best["Path"])
                & repeats["runs (commit)"].str.contains(str(best["run (commit)"]), regex=False)]
    if r.empty:
        return np.nan, "–"
    r = r.iloc[0]
    return float(r["vs fastest fp16: lowest"]), f"{r['vs fastest fp16: lowest']:.2f}-{r['vs fastest fp16: highest']:.2f}x ({r['runs']} runs)"


def decode_repeats(folder=None) -> pd.DataFrame:
    """Graphed decode rows measured in more than one run of the same package sources (the provenance's
    ``source_id``: commits that differ in data or text alone count as one), each with its spread over those
    runs: tok/s and "vs fastest fp16" (each run against its own fp16), lowest, median and highest. Repeat
    runs differ in the GPU they got (another card, or the other GPU of a two-GPU host) and, where plans
    were tuned in the run, in the tuner's picks; a target that falls inside a row's spread is not settled by
    one run. Random weights, real architectures. Empty where nothing was repeated."""
    cols = ["GPU", "Model (random weights)", "Scheme", "Path", "runs", "tok/s: lowest", "tok/s: median", "tok/s: highest",
            "vs fastest fp16: lowest", "vs fastest fp16: median", "vs fastest fp16: highest", "runs (commit)"]
    d = _decode_runs(folder)
    if d.empty or "source_id" not in d:
        return pd.DataFrame(columns=cols)
    d = d[d["path"].isin(GRAPHED_PATHS) & d["tok_s"].notna() & d["source_id"].notna()]
    rows = []
    for (gpu, model, scheme, path, fused, _), g in d.groupby(["gpu", "model", "scheme", "path", "fused", "source_id"], sort=False):
        if g["file"].nunique() < 2:
            continue
        ratio = g["tok_s"] / g["best_fp16_tok_s"]
        rows.append(dict(zip(cols, (gpu_label(gpu), model, scheme, path + (FUSED_SUFFIX if fused else ""), g["file"].nunique(),
                                    g["tok_s"].min(), g["tok_s"].median(), g["tok_s"].max(), ratio.min(), ratio.median(), ratio.max(),
                                    ", ".join(dict.fromkeys(g.sort_values("date")["git_commit"].astype(str).str[:7]))))))
    return pd.DataFrame(rows, columns=cols)


_PROJECTION_MODULES = ("trapetum::gemv::", "trapetum::additive::", "trapetum::residual::")


def _profile_part(kernel: str) -> str:
    """Which part of a fused-step token a profiled kernel (its demangled name) belongs to."""
    if kernel.startswith(_PROJECTION_MODULES):
        return "projections"
    return "attention" if kernel.startswith("trapetum::attention::") else "other"


def decode_step_profile(df: pd.DataFrame) -> pd.DataFrame:
    """Where a graphed fused-step token goes, for each fused-step row that recorded a profile
    (``bench --profile``: torch.profiler over graph replays in the same process): the token's wall
    time, its own kernels' bound (the projection and LM-head kernels it launches, each timed alone),
    the same kernels' time inside the step, attention, the other kernels (sampling, rotary) and the
    time between kernels. Wall = in-step projections + attention + other + between; the gap to the
    bound is the last three plus what the projections lose in sequence. Empty where none was profiled."""
    cols = ["GPU", "Model (random weights)", "Scheme", "tok/s", "token (us)", "own kernels alone (us)",
            "own kernels in the step (us)", "attention (us)", "other kernels (us)", "between kernels (us)"]
    if "profile" not in df:
        return pd.DataFrame(columns=cols)
    d = df[(df["path"] == "fused-step") & df["profile"].notna()]
    rows = []
    for _, r in d.iterrows():
        p = json.loads(r["profile"])
        parts = {"projections": 0.0, "attention": 0.0, "other": 0.0}
        for name, _calls, us in p["rows"]:
            parts[_profile_part(name)] += us
        bound = r.get("step_kernel_ms_per_token")
        bound = r.get("kernel_ms_per_token") if bound is None or pd.isna(bound) else bound
        rows.append(dict(zip(cols, (r["gpu_label"], r["model"], r["scheme"], r["tok_s"], p["wall_us"],
                                    np.nan if bound is None else 1e3 * float(bound), parts["projections"], parts["attention"],
                                    parts["other"], p["gaps_us"]))))
    return pd.DataFrame(rows, columns=cols)


def best_graphed(df: pd.DataFrame) -> pd.DataFrame:
    """Per GPU, model and scheme, the fastest of its graphed paths (graphed, compiled, fused-step)."""
    d = df[df["path"].isin(GRAPHED_PATHS) & df["tok_s"].notna()]
    return d.sort_values("tok_s").drop_duplicates(["gpu", "model", "scheme"], keep="last")


def fig_decode(df: pd.DataFrame) -> Figure:
    """Graphed decode: tok/s (top row) and peak VRAM (bottom row) of every scheme, one column a GPU,
    one bar colour a model (horizontal bars: the scheme names are long, and there are many)."""
    import seaborn as sns

    d = best_graphed(df)
    models = sorted(d["model"].unique(), key=lambda m: float(str(m).split("-")[-1].rstrip("b") or 0))
    gpus = sorted(d["gpu_label"].unique())
    # fp16 first, then the codebook schemes by name (a scheme and its head / embedding variants together)
    order = sorted(d["scheme"].unique(), key=lambda x: (x != "fp16", x))
    palette = dict(zip(models, sns.color_palette("colorblind", len(models))))
    with _style():
        fig = Figure(figsize=(6.5 * len(gpus) + 2.5, 2.2 + 0.62 * len(order) * len(models) ** 0.5))
        axes = fig.subplots(2, len(gpus), squeeze=False, sharey=True)
        for j, gpu in enumerate(gpus):
            g = d[d["gpu_label"] == gpu]
            for i, (col, label, what) in enumerate((("tok_s", "decode tok/s (fastest graphed path, batch 1)", "speed"),
                                                     ("vram_gb", "peak VRAM (GB)", "memory"))):
                ax = axes[i, j]
                sns.barplot(data=g, y="scheme", x=col, hue="model", order=order, hue_order=models, palette=palette,
                            orient="h", ax=ax, legend=(i == 0 and j == 0))
                ax.set_xlabel(label)
                ax.set_ylabel("" if j else "scheme")
                ax.set_title(f"{gpu}: {what}")
                if col == "vram_gb" and "80GB" in gpu.replace(" ", ""):
                    ax.axvline(80, color="0.3", ls=":", lw=1)
                    ax.annotate("80 GB", (80, 0), xytext=(-30, -2), textcoords="offset points", fontsize=8, va="top")
        leg = axes[0, 0].get_legend()
        if leg is not None:
            leg.remove()
            fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=len(models), frameon=False,
                       title="model (random weights); no bar: not measured or did not fit")
        fig.suptitle("Random weights, real Llama-2 architectures", fontsize=10)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


_GPU_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]


def should_measure(measure) -> bool:
    """A notebook's ``measure`` parameter: True, False, or "auto" (the default).

    "auto" measures when a CUDA GPU is visible, so ``papermill notebooks/gemv.ipynb out.ipynb -p
    arch sm_86`` reruns the chapter on the caller's GPU, and renders the recorded data otherwise
    (or when TRAPETUM_RENDER_ONLY=1, as `make book` sets it).
    """
    if isinstance(measure, bool):
        return measure
    if measure != "auto":
        raise ValueError(f"measure must be True, False or 'auto', got {measure!r}")
    import os

    import torch

    return os.environ.get("TRAPETUM_RENDER_ONLY", "") not in ("1", "true") and torch.cuda.is_available()


# -- the chapter "Vector codebooks" (notebooks/vq_gemv.ipynb) --------------------------------------
VQ = "vq_gemv"
SEEDS_DIR = results.DATA_DIR / "seeds"
# The seeds' VPTQ tables, transcribed in data/seeds/ (README there). Not measured here.
SEED_VPTQ = {"000": ("vptq-seed000.csv", "seed 000 (H100)"), "001": ("vptq-seed001.csv", "seed 001 (another GPU)")}
LARGE_RESIDUAL = 4096 * 28672  # the grid's target region: in x out at least this


def load_vq(folder=None) -> pd.DataFrame:
    """Every recorded ``vq_gemv*.json`` run as one DataFrame (timings and checks); raises if there is none.

    A run may measure one part only (``trapetum vq --parts residual``), so per GPU and part (the
    additive table, each kernel's correctness sweep, the fp16 baselines) the newest run that has it
    wins. The residual grid is taken configuration by configuration: a run stopped part way leaves
    configurations that only older runs measured, and each comes from the newest run that has it
    (:func:`residual_summary` says which runs). Every row keeps its own run's fp16 time and
    provenance (``file``, ``git_commit``).
    """
    root = _root(folder)
    df = results.load(VQ, root, every_run=True)
    if not df.empty:
        df["part"] = _vq_part(df)
        keep = df["date"] == df.groupby(["gpu", "part"], dropna=False)["date"].transform("max")
        grid = df[df["part"] == "residual"].sort_values("date", ascending=False)
        if not grid.empty:
            config = ["gpu", "batch", "in_features", "out_features", "main_centroids", "residual_centroids"]
            keep[grid.index] = ~grid.duplicated(config).to_numpy()
        df = df[keep].drop(columns="part").reset_index(drop=True)
    if df.empty:
        raise NoRecordedDataError(
            f"no GPU has recorded the vector-codebook measurements: found no {root}/<gpu>/{VQ}.json. "
            "Measure on a CUDA GPU with `trapetum vq` (or run notebooks/vq_gemv.ipynb with papermill), then rebuild the book.")
    df = _normalise(df)
    df["gpu_label"] = df["gpu"].map(gpu_label)
    return df


def _vq_part(df: pd.DataFrame) -> pd.Series:
    grid = df["grid"].astype(str)
    kernel = df.get("kernel", pd.Series("", index=df.index)).astype(str)
    return grid.where(grid != "correctness", "correctness " + kernel)


def load_vq_runs(folder=None, grid: str = "residual") -> pd.DataFrame:
    """One grid's records from every recorded run (kept-aside runs too), each with its run's commit:
    for comparing kernel versions measured in different runs."""
    df = results.load(VQ, _root(folder), every_run=True)
    if df.empty:
        return df
    df = _normalise(df[df["grid"] == grid].copy())
    df["gpu_label"] = df["gpu"].map(gpu_label)
    return df


def seed_vptq(which: str = "000") -> pd.DataFrame:
    """A seed's VPTQ table with its ratio (VPTQ time / torch time) turned into a speedup over fp16."""
    name, label = SEED_VPTQ[which]
    d = pd.read_csv(SEEDS_DIR / name)
    d["speedup"] = d["torch_ms"] / d["vptq_ms"]
    d["source"] = f"{SEED} {label}"
    return d


def _residual(df: pd.DataFrame) -> pd.DataFrame:
    d = df[(df["grid"] == "residual") & df["time_ms"].notna()].copy()
    for c in ("in_features", "out_features", "main_centroids", "residual_centroids"):
        d[c] = d[c].astype(int)
    return d


def pick_gpu(df: pd.DataFrame, prefer: str = "H100") -> str:
    """The GPU a single-GPU table shows: the first whose name contains `prefer`, else the first."""
    gpus = sorted(df["gpu"].dropna().unique())
    return next((g for g in gpus if prefer in g), gpus[0])


def residual_grid_table(df: pd.DataFrame, gpu: str | None = None) -> pd.DataFrame:
    """The 120-config grid in seed 000's format, ours beside the seeds' reported speedups."""
    d = _residual(df)
    gpu = gpu or pick_gpu(d)
    d = d[d["gpu"] == gpu].sort_values(["main_centroids", "residual_centroids", "out_features", "in_features"])
    s0 = seed_vptq("000").set_index(["in_features", "out_features", "main_centroids", "residual_centroids"])["speedup"]
    s1 = seed_vptq("001").set_index(["in_features", "out_features"])["speedup"]
    key0 = list(zip(d["in_features"], d["out_features"], d["main_centroids"], d["residual_centroids"]))
    g = gpu_label(gpu)
    return pd.DataFrame({
        "count": np.arange(1, len(d) + 1),
        "in_features": d["in_features"].to_numpy(), "out_features": d["out_features"].to_numpy(),
        "main": d["main_centroids"].to_numpy(), "residual": d["residual_centroids"].to_numpy(),
        "bits/weight": d["bits_per_weight"].to_numpy(),
        f"{g}: ours (ms)": d["time_ms"].to_numpy(), f"{g}: torch fp16 (ms)": d["fp16_ms"].to_numpy(),
        f"{g}: speedup": d["speedup"].to_numpy(), f"{g}: max rel err": d["max_rel_err"].to_numpy(),
        f"VPTQ speedup, {SEED} 000 (H100)": [s0.get(k, np.nan) for k in key0],
        f"VPTQ speedup, {SEED} 001 (other GPU)": [s1.get(k[:2], np.nan) for k in key0],
    })


def _geomean(x) -> float:
    x = np.asarray(x, dtype=float)
    return float(np.exp(np.log(x).mean())) if len(x) else np.nan


def fp16_baseline_inversions(df: pd.DataFrame, margin: float = 1.1) -> pd.DataFrame:
    """Shapes where a GPU's torch fp16 GEMV (the denominator of every speedup) took longer than on a shape
    with as many outputs and more inputs in the same recorded runs (by more than ``margin``): cuBLAS picked a
    slow kernel there, so that shape's speedup says more about the baseline than about our kernel."""
    b = df[(df["grid"] == "baseline") & df["time_ms"].notna()]
    if b.empty:
        return pd.DataFrame()
    t = b.groupby(["gpu", "out_features", "in_features"])["time_ms"].median().reset_index()
    rows = []
    for (gpu, n_out), g in t.groupby(["gpu", "out_features"]):
        g = g.sort_values("in_features")
        for _, a in g.iterrows():
            big = g[(g["in_features"] > a["in_features"]) & (g["time_ms"] * margin < a["time_ms"])]
            if len(big):
                c = big.iloc[0]
                rows.append({"GPU": gpu_label(gpu), "shape (in x out)": f"{int(a['in_features'])} x {int(n_out)}",
                             "fp16 (µs)": a["time_ms"] * 1e3, "larger shape": f"{int(c['in_features'])} x {int(n_out)}",
                             "its fp16 (µs)": c["time_ms"] * 1e3})
    return pd.DataFrame(rows)


def fp16_run_spread(df: pd.DataFrame, folder=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """How far the grid's verdicts (faster or slower than fp16) rest on one run's fp16 time. Each configuration
    shown (``df``, :func:`load_vq`) keeps its own run's fp16 time, the issue's ratio; but torch fp16 of one shape
    varies from run to run. Against every fp16 time recorded for its shape on its GPU (one a process, from every
    run of the grid, :func:`load_vq_runs`), a configuration is faster than the slowest of them, the fastest, or
    in between. Returns (a row a GPU: the counts, the fp16 timings a shape and their spread; the configurations
    whose verdict depends on the run)."""
    cur = _residual(df)
    runs = load_vq_runs(folder)
    if cur.empty or runs.empty:
        return pd.DataFrame(), pd.DataFrame()
    # one timing a process: a run's configurations of one shape share their process's fp16 time (a run of two
    # processes, the second resuming the first, has two)
    runs = runs[runs["fp16_ms"].notna()].drop_duplicates(["gpu", "file", "in_features", "out_features", "fp16_ms"])
    for c in ("in_features", "out_features"):
        runs[c] = runs[c].astype(int)
    f = runs.groupby(["gpu", "in_features", "out_features"])["fp16_ms"].agg(["min", "median", "max", "size"]).reset_index()
    m = cur.merge(f, on=["gpu", "in_features", "out_features"], how="inner")
    m["lo"], m["hi"] = m["min"] / m["time_ms"], m["max"] / m["time_ms"]
    rows, detail = [], []
    for gpu, g in m.groupby("gpu"):
        rows.append({"GPU": gpu_label(gpu), "configs": len(g), "faster than fp16 of its own run": int((g["speedup"] > 1).sum()),
                     "faster than the fastest fp16 recorded": int((g["lo"] > 1).sum()),
                     "faster than the slowest fp16 recorded": int((g["hi"] > 1).sum()),
                     "fp16 timings a shape": f"{int(g['size'].min())}-{int(g['size'].max())}",
                     "fp16 spread a shape, median (max - min over median, %)": float((100 * (g["max"] - g["min"]) / g["median"]).median())})
        d = g[(g["lo"] <= 1) & (g["hi"] > 1)].sort_values(["in_features", "out_features", "main_centroids", "residual_centroids"])
        for _, r in d.iterrows():
            detail.append({"GPU": gpu_label(gpu), "in x out": shape_label((int(r["in_features"]), int(r["out_features"]))),
                           "codebooks": f"{int(r['main_centroids'])}+{int(r['residual_centroids'])}", "ours (us)": 1e3 * r["time_ms"],
                           "fp16, its run (us)": 1e3 * r["fp16_ms"], "fp16, fastest run (us)": 1e3 * r["min"],
                           "fp16, slowest run (us)": 1e3 * r["max"], "speedup, its run": r["speedup"],
                           "speedup range over the runs": f"{r['lo']:.2f}-{r['hi']:.2f}"})
    return pd.DataFrame(rows), pd.DataFrame(detail)


def residual_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per GPU, the issue's three measures of the grid, with seed 000's VPTQ kernel as reported."""
    d = _residual(df)
    rows = []

    def row(source, g):
        large = g[g["in_features"] * g["out_features"] >= LARGE_RESIDUAL]
        return {"source": source, "configs": len(g), "faster than fp16": int((g["speedup"] > 1).sum()),
                "geometric-mean speedup": _geomean(g["speedup"]), "slowest speedup": g["speedup"].min(),
                "min speedup at in x out >= 4096 x 28672": large["speedup"].min() if len(large) else np.nan}

    for gpu, g in d.groupby("gpu"):
        r = row(f"ours, {gpu_label(gpu)} ({MEASURED})", g)
        # Newest run first: a run that stopped part way is completed from older runs (load_vq).
        # Processes of one commit (a grid split over GPUs or calls) count as one entry.
        runs = g.groupby("git_commit").agg(n=("date", "size"), newest=("date", "max")).sort_values("newest", ascending=False)
        r["runs (commit: configs)"] = ", ".join(f"{str(c)[:7]}: {n}" for c, n in runs["n"].items())
        r["max rel err (worst)"] = g["max_rel_err"].max()
        r["median % of copy bandwidth"] = float((100 * g["gbps"] / g["copy_gbps"]).median())
        rows.append(r)
    rows.append(row("VPTQ, reported by seed 000 (H100)", seed_vptq("000")))
    return pd.DataFrame(rows)


RESIDUAL_VERSION_SHAPES = ((4096, 4096), (4096, 28672), (16384, 53248))


def _residual_kernel_label(g: pd.DataFrame) -> str:
    variants = set(g["variant"].dropna()) if "variant" in g else set()
    if not variants:
        return "gather (v1): codebook vectors rebuilt a group"
    if "build" in g and (g["build"] == "banked").any():
        variants = (variants - {"table"}) | {"table (tensor-core or banked fp16)"}
    elif "build" in g and (g["build"] == "mma").any():
        variants = (variants - {"table"}) | {"table (fma or tensor-core build)"}
    elif variants == {"table"}:
        return "table (v2): dot-product tables, 4096 rows a table"
    return "per shape: " + " or ".join(sorted(variants)) + ", tuned"


def residual_versions(folder=None, Nm: int = 4096, Nr: int = 256) -> pd.DataFrame:
    """Every recorded run of the residual grid, oldest first: which kernel, how much of the grid it
    covered, how often it beat fp16, its geometric mean, and its speedup at a few shapes (codebooks
    Nm + Nr). Each run's own fp16 times; the commit says which code measured it."""
    d = load_vq_runs(folder, "residual")
    if d.empty:
        return pd.DataFrame()
    d = d[d["time_ms"].notna()]
    rows = []
    for (gpu, f), g in sorted(d.groupby(["gpu", "file"]), key=lambda kv: str(kv[1]["date"].iloc[0])):
        r = {"GPU": gpu_label(gpu), "commit": g["git_commit"].iloc[0], "date": str(g["date"].iloc[0])[:16],
             "kernel": _residual_kernel_label(g), "configs": len(g), "faster than fp16": int((g["speedup"] > 1).sum()),
             "geometric-mean speedup": _geomean(g["speedup"])}
        c = g[(g["main_centroids"].astype(int) == Nm) & (g["residual_centroids"].astype(int) == Nr)]
        for n_in, n_out in RESIDUAL_VERSION_SHAPES:
            v = c[(c["in_features"].astype(int) == n_in) & (c["out_features"].astype(int) == n_out)]["speedup"]
            r[f"{n_in} x {n_out} ({Nm}+{Nr})"] = float(v.iloc[0]) if len(v) else np.nan
        rows.append(r)
    return pd.DataFrame(rows)


def residual_choices(df: pd.DataFrame) -> pd.DataFrame:
    """How often the tuner picked each residual kernel and placement, by GPU and output size (each
    GPU's newest run: the tuner times the candidates on the GPU it runs on, so the picks differ)."""
    d = _residual(df)
    if "variant" not in d:
        return pd.DataFrame()
    placement = d["main_placement"] if "main_placement" in d else pd.Series(np.nan, index=d.index)
    build = d["build"] if "build" in d else pd.Series(np.nan, index=d.index)
    b = build.astype(object)
    built = np.where(b == "mma", ", built on tensor cores", np.where(b == "banked", ", banked fp16 (v6)", ""))
    spread = d["spread"] if "spread" in d else pd.Series(np.nan, index=d.index)
    built = built + np.where(spread.eq(True), ", finish spread", "")  # (NaN where not recorded)
    d["kernel chosen"] = d["variant"].fillna("gather") + built + ", codebook in " + placement.fillna("(not recorded)").astype(str)
    d["GPU"] = d["gpu"].map(gpu_label) if "gpu" in d else "(not recorded)"
    t = d.pivot_table(index=["GPU", "kernel chosen"], columns="out_features", values="speedup", aggfunc="size", fill_value=0)
    t.columns = [f"out {c}" for c in t.columns]
    return t.reset_index()


def fig_residual_heatmap(df: pd.DataFrame, gpu: str | None = None) -> Figure:
    """Speedup over fp16 on the grid: ours, a row of panels for each GPU recorded (the H100 first; only
    ``gpu`` if given), and VPTQ as seed 000 reports it (bottom row). One colour scale for all rows."""
    d = _residual(df)
    first = pick_gpu(d)
    gpus = [gpu] if gpu else sorted(d["gpu"].dropna().unique(), key=lambda g: (g != first, g))
    d = d[d["gpu"].isin(gpus)]
    seed = seed_vptq("000")
    configs = [(m, r) for m in sorted(d["main_centroids"].unique()) for r in sorted(d["residual_centroids"].unique())]
    ins, outs = sorted(d["in_features"].unique()), sorted(d["out_features"].unique())
    norm = mpl.colors.TwoSlopeNorm(vmin=0.2, vcenter=1.0, vmax=max(2.0, float(d["speedup"].max())))
    rows = [(d[d["gpu"] == g], f"ours, {gpu_label(g)}") for g in gpus] + [(seed, "VPTQ, reported by seed 000 (H100)")]
    with _style():
        fig = Figure(figsize=(3.3 * len(configs), 3.3 * len(rows)), layout="constrained")
        axes = np.atleast_2d(fig.subplots(len(rows), len(configs), sharex=True, sharey=True))
        for j, (m, r) in enumerate(configs):
            for i, (src, label) in enumerate(rows):
                g = src[(src["main_centroids"] == m) & (src["residual_centroids"] == r)]
                grid = g.pivot_table(index="in_features", columns="out_features", values="speedup").reindex(index=ins, columns=outs)
                ax = axes[i, j]
                im = ax.imshow(grid.to_numpy(), cmap="RdBu", norm=norm, origin="lower", aspect="auto")
                for (a, b), v in np.ndenumerate(grid.to_numpy()):
                    if np.isfinite(v):
                        dark = abs(float(norm(v)) - 0.5) > 0.3
                        ax.text(b, a, f"{v:.1f}", ha="center", va="center", fontsize=7.5, color="white" if dark else "black")
                runs = ""
                if src is not seed and "git_commit" in g and g["git_commit"].notna().any():  # the grid may join runs (load_vq)
                    runs = "\nrun " + ", ".join(sorted(g["git_commit"].dropna().astype(str).str[:7].unique()))
                ax.set_title(f"{label}\nmain {m}, residual {r}{runs}", fontsize=9)
                ax.set_xticks(range(len(outs)), [str(o) for o in outs], rotation=45, fontsize=8)
                ax.set_yticks(range(len(ins)), [str(v) for v in ins], fontsize=8)
                ax.grid(False)
        for ax in axes[-1]:
            ax.set_xlabel("out_features")
        for ax in axes[:, 0]:
            ax.set_ylabel("in_features")
        fig.colorbar(im, ax=axes, shrink=0.8, label="speedup over torch fp16 (blue: faster)")
    return fig


ADDITIVE_KERNELS = {"additive": "ours (numba)", "aqlm package 2x8": "aqlm package", "cuda_cpp_additive": "ours (CUDA C++)"}


def additive_table_label(rec: dict) -> str:
    """How a timed additive kernel built its lookup table and what its entries were (numba runs
    before the tensor-core build recorded no ``build``, before fp16 tables no ``table``: both were
    the only kind then, multiply-adds and fp32)."""
    build, table, plan = rec.get("build"), rec.get("table"), rec.get("plan")
    if rec.get("kernel") == "additive" and build == "stream":  # the chunk kernel's plans are StreamPlans too
        which = "chunk" if isinstance(plan, str) and plan.startswith("additive chunk") else "streaming"
        return f"fp16, tensor cores ({which} kernel)"
    if rec.get("kernel") == "additive":
        how = "tensor cores" if build == "mma" else "multiply-adds"
        return f"{table if isinstance(table, str) else 'fp32'}, {how}"
    if isinstance(plan, str) and "lut" in plan:  # the C++ program's plan label: lut16 / lut32
        return "fp16, tensor cores" if "lut16" in plan else "fp32, tensor cores"
    return ""


def additive_plan_label(rec: dict) -> str:
    """The launch plan a timed additive row ran (the tuner's pick for numba, the C++ program's own), without
    the kernel family's name; empty where the run recorded none (the aqlm package)."""
    plan = rec.get("plan")
    if not isinstance(plan, str):
        return ""
    return plan.removeprefix("additive ").removeprefix("additive: ")


def additive_table(df: pd.DataFrame) -> pd.DataFrame:
    """Additive kernels against fp16 by GPU, shape and scheme: time, speedup, bandwidth and error, and the
    plan each ran."""
    d = df[(df["grid"] == "additive") & df["time_ms"].notna()].copy()
    d["table"] = [additive_table_label(r) for r in d.to_dict("records")]
    d["plan"] = [additive_plan_label(r) for r in d.to_dict("records")]
    d["kernel"] = d["kernel"].map(lambda k: ADDITIVE_KERNELS.get(k, k))
    d["% of copy"] = 100 * d["gbps"] / d["copy_gbps"]
    d = d.sort_values(["gpu", "scheme", "in_features", "out_features", "kernel"])
    return pd.DataFrame({
        "GPU": d["gpu"].map(gpu_label).to_numpy(), "scheme": d["scheme"].to_numpy(), "kernel": d["kernel"].to_numpy(),
        "table": d["table"].to_numpy(),
        "in x out": [shape_label(s) for s in zip(d["in_features"], d["out_features"])],
        "time (ms)": d["time_ms"].to_numpy(), "torch fp16 (ms)": d["fp16_ms"].to_numpy(),
        "speedup": d["speedup"].to_numpy(), "GB/s": d["gbps"].to_numpy(), "% of copy": d["% of copy"].to_numpy(),
        "max rel err": d["max_rel_err"].to_numpy(), "plan": d["plan"].to_numpy(),
    })


def additive_side_by_side(df: pd.DataFrame, scheme: str = "2-bit additive (M=2)") -> pd.DataFrame:
    """2-bit additive, one row per GPU and shape: each kernel's speedup over fp16, and ours over the aqlm package."""
    d = df[(df["grid"] == "additive") & (df["scheme"] == scheme) & df["time_ms"].notna()].copy()
    d["who"] = d["kernel"].map(lambda k: ADDITIVE_KERNELS.get(k, k))
    t = d.pivot_table(index=["gpu", "in_features", "out_features"], columns="who", values="time_ms", aggfunc="min")
    sp = d.pivot_table(index=["gpu", "in_features", "out_features"], columns="who", values="speedup", aggfunc="max")
    out = pd.DataFrame({"GPU": [gpu_label(g) for g, _, _ in t.index],
                        "in x out": [shape_label((a, b)) for _, a, b in t.index]})
    for who in ("ours (numba)", "ours (CUDA C++)", "aqlm package"):
        if who in t:  # each against the fp16 time of its own measurement (the C++ program times cuBLAS itself)
            out[f"{who}: speedup"] = sp[who].to_numpy()
    if "aqlm package" in t:
        for who in ("ours (numba)", "ours (CUDA C++)"):
            if who in t:
                out[f"{who} vs aqlm package"] = (t["aqlm package"] / t[who]).to_numpy()
    if "ours (CUDA C++)" in t and "ours (numba)" in t:
        out["numba time / CUDA C++ time"] = (t["ours (numba)"] / t["ours (CUDA C++)"]).to_numpy()
    return out


ADDITIVE_QUEUE_PROBES = "_runs/additive-queue-*.json"  # the queue plans' probes (their code is in git history)


def _probe_files(folder, pattern: str):
    """Each probe file under ``folder`` matching ``pattern``, oldest first (by its provenance's date, then
    name): (file name, provenance, records)."""
    probes = [(f.name, json.loads(f.read_text())) for f in _root(folder).glob(pattern)]
    for name, data in sorted(probes, key=lambda p: (str(p[1]["provenance"].get("date")), p[0])):
        yield name, data["provenance"], data["records"]


def _probe_runs(folder, pattern: str, short: bool = False, kind: str = "time"):
    """Each probe file under ``folder`` matching ``pattern``, oldest first: (provenance, a label of its
    commit and how many correctness checks passed before it timed anything, its records of ``kind``:
    timings by default)."""
    for _, prov, recs in _probe_files(folder, pattern):
        checks = [r for r in recs if r.get("kind") == "check"]
        commit = str(prov.get("git_commit"))
        label = f"{commit[:7] if short else commit} ({sum(bool(c['passed']) for c in checks)}/{len(checks)} checks)"
        yield prov, label, pd.DataFrame([r for r in recs if r.get("kind") == kind])


def additive_queue_trial(folder=None) -> pd.DataFrame:
    """The additive kernel's queue plans, tried and reverted: one row a shape and M, one column a
    probe (its commit and how many correctness checks passed before it timed anything): the fastest
    queue plan's time over the tuned static-grid plan's, both timed in that probe's process."""
    rows = []
    for prov, probe, t in _probe_runs(folder, ADDITIVE_QUEUE_PROBES):
        if t.empty:
            continue
        t["queued"] = ~t["plan"].str.contains("'queue': 0")
        for (n_in, n_out, M), g in t.groupby(["n_in", "n_out", "M"], sort=False):
            static, queue = g[~g["queued"]], g[g["queued"]]
            if len(static) and len(queue):
                rows.append({"GPU": gpu_label(prov.get("gpu", "")), "in x out": shape_label((int(n_in), int(n_out))), "M": int(M),
                             "static grid, tuned (us)": float(static["us"].iloc[0]), "probe": probe,
                             "ratio": float(queue["us"].min() / static["us"].iloc[0])})
    if not rows:
        return pd.DataFrame()
    d = pd.DataFrame(rows)
    out = d.pivot_table(index=["GPU", "in x out", "M"], columns="probe", values="ratio", sort=False)
    out.columns = [f"{c}: fastest queue plan / static" for c in out.columns]
    last = d.drop_duplicates(["GPU", "in x out", "M"], keep="last").set_index(["GPU", "in x out", "M"])
    out.insert(0, "static grid, tuned (us)", last["static grid, tuned (us)"])
    return out.reset_index()


ADDITIVE_STREAM_PROBES = "_runs/additive-stream-v2-*.json"  # the streaming kernel's probe, every plan timed


def additive_stream_probe(folder=None) -> pd.DataFrame:
    """The streaming additive kernel's probe (M=2, batch 1), one row a GPU and shape: torch fp16, the
    fastest streaming plan and its time, and the table kernel's tuned time where the probe timed it in
    the same process (the recorded runs above keep only the tuner's pick)."""
    from .additive import D, stream_chunks, stream_slices  # numba and torch: only where this table is drawn

    rows = []
    for prov, probe, t in _probe_runs(folder, ADDITIVE_STREAM_PROBES, short=True):
        if t.empty:
            continue
        for (n_in, n_out), g in t.groupby(["in_features", "out_features"], sort=False):
            s, tab = g[g["kernel"] == "stream"], g[g["kernel"] == "table (tuned)"]
            if s.empty:
                continue
            best = s.loc[s["time_us"].idxmin()]
            plan = best["plan"]
            _, ks = stream_slices(stream_chunks(int(n_in) // D), int(plan["ksplit"]))  # the K-split the plan ran
            rows.append({"GPU": gpu_label(prov.get("gpu", "")), "in x out": shape_label((int(n_in), int(n_out))),
                         "torch fp16 (us)": float(best["fp16_us"]),
                         "fastest streaming plan": f"{plan['warps']} warps, K-split {ks}, {plan['slots']} code slots",
                         "streaming (us)": float(best["time_us"]), "streaming: speedup": float(best["fp16_us"] / best["time_us"]),
                         "table kernel, tuned (us)": float(tab["time_us"].min()) if len(tab) else float("nan"), "probe": probe})
    return pd.DataFrame(rows)


ADDITIVE_CHUNK_PROBES = "_runs/chunk-probe-*.json"  # the chunk kernel's probe: the previous pick and every chunk plan


def additive_chunk_probe(folder=None) -> pd.DataFrame:
    """The chunk kernel's probe (M=2, batch 1), one row a GPU and shape: torch fp16, the plan the
    tuner had picked before the kernel existed (table or streaming kernel, forced) and the fastest
    chunk plan, both timed in the probe's process (fastest of two interleaved passes), and the probe
    (its commit and how many checks passed before it timed anything)."""
    rows = []
    for prov, probe, t in _probe_runs(folder, ADDITIVE_CHUNK_PROBES, short=True):
        if t.empty:
            continue
        for (n_in, n_out), g in t.groupby(["in_features", "out_features"], sort=False):
            old, chunk = g[g["name"] == "old"], g[g["name"].str.startswith("chunk")]
            if old.empty or chunk.empty:
                continue
            best, was = chunk.loc[chunk["time_ms"].idxmin()], old.iloc[0]
            rows.append({"GPU": gpu_label(prov.get("gpu", "")), "in x out": shape_label((int(n_in), int(n_out))),
                         "torch fp16 (us)": 1e3 * float(best["fp16_ms"]), "previous pick": str(was["label"]).split(": ", 1)[-1],
                         "previous (us)": 1e3 * float(was["time_ms"]), "fastest chunk plan": str(best["label"]).split(": ", 1)[-1],
                         "chunk (us)": 1e3 * float(best["time_ms"]), "chunk: speedup": float(best["fp16_ms"] / best["time_ms"]),
                         "previous / chunk": float(was["time_ms"] / best["time_ms"]), "probe": probe})
    return pd.DataFrame(rows)


CHUNK_ABLATIONS = "_runs/chunk-ablation-*.json"  # the chunk kernel with one stage left out
CHUNK_PARTS = {"full": "full kernel (us)", "nobuild": "no table build (us)", "nolook": "no lookups (us)",
               "noload": "no code loads (us)", "nofinish": "no K-slice finish (us)", "skeleton": "no build, no lookups (us)"}
CHUNK_CLUSTER_PROBES = "_runs/cluster-finish-probe-*.json"  # every chunk plan with its global finish and with a cluster
CHUNK_RMS_PROBES = "_runs/cluster-rms-probe-*.json"  # plain and rms, global finish and cluster, same plans
RMS_GLOBAL_PROBES = "_runs/rms-global-probe-*.json"  # the global finish's rms: whole row read first, or deferred


def _chunk_plan_label(plan: str) -> str:
    """A chunk plan's dict, as the probes record it, in a few words."""
    p = ast.literal_eval(plan)
    return f"{p['warps']} warps, {p['rows']} rows a block, tiles of {4 * p['tile']}"


def chunk_ablation(folder=None) -> pd.DataFrame:
    """The chunk kernel timed with one stage left out (outputs wrong on purpose, timing only; the full
    kernel checked first), one row a GPU, shape and plan, one column a variant, in microseconds."""
    rows = []
    for prov, _, t in _probe_runs(folder, CHUNK_ABLATIONS):
        for r in t.to_dict("records"):
            rows.append({"GPU": gpu_label(prov.get("gpu", "")), "in x out": shape_label((int(r["in_features"]), int(r["out_features"]))),
                         "plan": _chunk_plan_label(r["plan"]), "torch fp16 (us)": 1e3 * float(r["fp16_ms"]),
                         "part": CHUNK_PARTS.get(r["ablation"], r["ablation"]), "us": 1e3 * float(r["time_ms"])})
    if not rows:
        return pd.DataFrame()
    out = pd.DataFrame(rows).pivot_table(index=["GPU", "in x out", "plan", "torch fp16 (us)"], columns="part", values="us", sort=False)
    return out[[c for c in CHUNK_PARTS.values() if c in out.columns]].reset_index()


def chunk_cluster_probe(folder=None) -> pd.DataFrame:
    """The chunk kernel's chunks meeting in a thread block cluster against its global finish (M=2,
    batch 1), one row a GPU and shape: the fastest plan of each (every chunk plan timed both ways in
    one process, fastest of two interleaved passes), fp16 beside them, and the probe (its commit and
    how many checks passed before it timed anything)."""
    rows = []
    for prov, probe, t in _probe_runs(folder, CHUNK_CLUSTER_PROBES, short=True):
        if t.empty:
            continue
        for (n_in, n_out), g in t.groupby(["in_features", "out_features"], sort=False):
            glob, clus = g[~g["cluster"].astype(bool)], g[g["cluster"].astype(bool)]
            if glob.empty or clus.empty:
                continue
            a, b = glob.loc[glob["time_ms"].idxmin()], clus.loc[clus["time_ms"].idxmin()]
            rows.append({"GPU": gpu_label(prov.get("gpu", "")), "in x out": shape_label((int(n_in), int(n_out))),
                         "torch fp16 (us)": 1e3 * float(a["fp16_ms"]), "fastest, global finish": _chunk_plan_label(a["plan"]),
                         "global (us)": 1e3 * float(a["time_ms"]), "fastest, cluster finish": _chunk_plan_label(b["plan"]),
                         "cluster (us)": 1e3 * float(b["time_ms"]), "global / cluster": float(a["time_ms"] / b["time_ms"]),
                         "best: speedup": float(a["fp16_ms"] / min(a["time_ms"], b["time_ms"])), "probe": probe})
    return pd.DataFrame(rows)


def chunk_rms_probe(folder=None) -> pd.DataFrame:
    """What the decode step's fused RMSNorm costs the chunk kernel, one row a GPU, shape and plan: plain
    and rms launches with the global finish (every block reads the whole row before its build) and with
    the cluster finish (each block sums its own chunk's squares, the cluster adds them where it writes
    y), in microseconds (fastest of three interleaved passes, one process), and each rms penalty."""
    rows = []
    for prov, _, t in _probe_runs(folder, CHUNK_RMS_PROBES):
        if t.empty:
            continue
        t["finish"] = t["name"].str.split().str[0]
        for (n_in, n_out, plan), g in t.assign(key=t["plan"].map(lambda s: str({k: v for k, v in ast.literal_eval(s).items()
                                                                                  if k != "cluster"}))).groupby(
                ["in_features", "out_features", "key"], sort=False):
            us = {(r["finish"], r["pre"] or "plain"): 1e3 * float(r["time_ms"]) for r in g.to_dict("records")}
            row = {"GPU": gpu_label(prov.get("gpu", "")), "in x out": shape_label((int(n_in), int(n_out))), "plan": _chunk_plan_label(plan)}
            for fin in ("global", "cluster"):
                row[f"{fin}: plain (us)"] = us.get((fin, "plain"), float("nan"))
                row[f"{fin}: rms (us)"] = us.get((fin, "rms"), float("nan"))
                row[f"{fin}: rms penalty (us)"] = row[f"{fin}: rms (us)"] - row[f"{fin}: plain (us)"]
            rows.append(row)
    return pd.DataFrame(rows)


def rms_global_probe(folder=None) -> pd.DataFrame:
    """The fused RMSNorm in the chunk kernel's global-finish plans, before and after it was deferred, one
    row a GPU, shape and plan: the plain launch, the rms launch that reads the whole row before its build
    (the code before, imported beside the new), and the deferred one (each block sums its own chunk's
    squares, the finishing block applies 1 / rms), in microseconds (fastest of three interleaved passes,
    one process), with each rms penalty over the plain launch."""
    rows = []
    for prov, label, t in _probe_runs(folder, RMS_GLOBAL_PROBES, short=True):
        if t.empty:
            continue
        for (n_in, n_out, plan), g in t.groupby(["in_features", "out_features", "plan"], sort=False):
            us = {(str(r["name"]).split()[0], r["pre"] or "plain"): 1e3 * float(r["time_ms"]) for r in g.to_dict("records")}
            row = {"GPU": gpu_label(prov.get("gpu", "")), "in x out": shape_label((int(n_in), int(n_out))), "plan": _chunk_plan_label(plan),
                   "plain (us)": us.get(("deferred", "plain"), np.nan), "rms, whole row first (us)": us.get(("whole", "rms"), np.nan),
                   "rms, deferred (us)": us.get(("deferred", "rms"), np.nan)}
            row["penalty before (us)"] = row["rms, whole row first (us)"] - row["plain (us)"]
            row["penalty now (us)"] = row["rms, deferred (us)"] - row["plain (us)"]
            rows.append(row | {"probe": label})
    return pd.DataFrame(rows)


def _chunk_case(prov: dict, what: str, n_in, n_out, pre, post, plan: str) -> dict:
    """The columns every chunk-kernel probe's row starts with: GPU, layer, shape, fused operations, plan."""
    return {"GPU": gpu_label(prov.get("gpu", "")), "layer": "additive table" if what.startswith("issue 3") else what,
            "in x out": shape_label((int(n_in), int(n_out))), "fused": f"{pre or '-'} / {post or '-'}",
            "plan": _chunk_plan_label(plan)}


def _chunk_variants(t: pd.DataFrame, keys=("what", "in_features", "out_features", "pre", "post", "plan")):
    """A variants probe's timing records by case: (the case's ``keys``, by default what, in, out, pre,
    post, plan; its records; their microseconds by variant), in the probe's order."""
    for keys, g in t.groupby(list(keys), sort=False):
        yield keys, g, {r["variant"]: 1e3 * float(r["time_ms"]) for r in g.to_dict("records")}


FINISH_PROBES = "_runs/finish-probe*.json"  # the chunk kernel's K-split finish, versions of the code side by side
FINISH_VARIANTS = {"e8ac594": "e8ac594", "e8+sum_splits": "+ sum_splits tail", "04bc3b8": "+ overflow check (04bc3b8)",
                   "new": "+ wide finish"}


def finish_probe(folder=None) -> pd.DataFrame:
    """The chunk kernel's K-split finish at the plans the 2-bit decode uses, four versions of the code in
    one process (fastest of three interleaved passes): e8ac594; its additive.py on the later
    ``sum_splits`` (the last slices loaded at once); 04bc3b8 (that, plus the deferred norm's overflow
    check); and the finishing thread summing ``fw`` adjacent rows with wide loads (a later probe times
    04bc3b8 and the wide finish only). One row a GPU, layer, fused operation, plan and probe, in
    microseconds, with torch fp16 timed beside them."""
    from .additive import chunk_finish_rows

    rows = []
    for prov, label, t in _probe_runs(folder, FINISH_PROBES, short=True):
        if t.empty:
            continue
        for keys, g, us in _chunk_variants(t):
            p = ast.literal_eval(keys[-1])
            row = _chunk_case(prov, *keys) | {"rows a thread": chunk_finish_rows(p["rows"] // 4, p["warps"])}
            row |= {f"{name} (us)": us.get(v, np.nan) for v, name in FINISH_VARIANTS.items()}
            row["torch fp16 (us)"] = 1e3 * float(g["fp16_ms"].iloc[0])
            row["speedup now"] = row["torch fp16 (us)"] / row["+ wide finish (us)"]
            rows.append(row | {"probe": label})
    return pd.DataFrame(rows)


RESTAGE_PROBES = "_runs/restage-probe*.json"  # session 56: the restage pass, the finishes' loads in flight, 16-warp bounds
RESTAGE_VARIANTS = {"e33ce3d": "restage a branch (e33ce3d)", "d4029ca": "restage a pass (d4029ca)"}


def restage_probe(folder=None) -> pd.DataFrame:
    """The chunk kernel at the plans the 2-bit decode uses, up to three versions of the code in one
    process (fastest of three interleaved passes): the deferred norm's overflow restage as a branch
    (e33ce3d; rms layers only), as a second pass of the one staging call (d4029ca), and the probe's own
    commit. One row a GPU, layer, fused operation, plan and probe, in microseconds, with torch fp16."""
    rows = []
    for prov, label, t in _probe_runs(folder, RESTAGE_PROBES, short=True):
        if t.empty or "pre" not in t:
            continue
        t = t[t["pre"].notna()]
        for keys, g, us in _chunk_variants(t):
            row = _chunk_case(prov, *keys) | {"rows a thread": int(g["fw"].iloc[0]), "K-slices": int(g["nsplit"].iloc[0])}
            row |= {f"{name} (us)": us.get(v, np.nan) for v, name in RESTAGE_VARIANTS.items()}
            row["the probe's commit (us)"] = us.get("new", np.nan)
            row["torch fp16 (us)"] = 1e3 * float(g["fp16_ms"].iloc[0])
            row["speedup"] = row["torch fp16 (us)"] / row["the probe's commit (us)"]
            rows.append(row | {"probe": label})
    return pd.DataFrame(rows)


def lut_finish_probe(folder=None) -> pd.DataFrame:
    """The 4-bit lut kernel's K-split finish, d4029ca (warp 0 sums the block's RB x B rows a lane, 16
    loads in flight) against the probe's commit (the rows over the block's warps, 32 loads in flight),
    at fixed plans, in one process (fastest of three interleaved passes): one row a GPU, shape, batch,
    plan and probe, in microseconds, with torch fp16. The plans are fixed, not tuned: the times are not
    the gemv table's."""
    from .gemv import LaunchPlan  # numba and torch: only where this table is drawn

    rows = []
    for prov, label, t in _probe_runs(folder, RESTAGE_PROBES, short=True):
        if t.empty or "batch" not in t:
            continue
        for (n_in, n_out, B, plan), g in t[t["batch"].notna()].groupby(["in_features", "out_features", "batch", "plan"], sort=False):
            us = {r["variant"]: 1e3 * float(r["time_ms"]) for r in g.to_dict("records")}
            kw = {k.arg: ast.literal_eval(k.value) for k in ast.parse(plan, mode="eval").body.keywords}  # the LaunchPlan's repr
            row = {"GPU": gpu_label(prov.get("gpu", "")), "in x out": shape_label((int(n_in), int(n_out))), "batch": int(B),
                   "plan": LaunchPlan(**kw).label(),
                   "warp 0 finishes (d4029ca, us)": us.get("d4029ca", np.nan), "the warps finish (us)": us.get("new", np.nan),
                   "torch fp16 (us)": 1e3 * float(g["fp16_ms"].iloc[0])}
            row["saved (us)"] = row["warp 0 finishes (d4029ca, us)"] - row["the warps finish (us)"]
            rows.append(row | {"probe": label})
    return pd.DataFrame(rows)


CHUNK_STAGE_PROBES = "_runs/chunk-stages-*.json"  # the chunk kernel with one stage left out, at the 70B decode's plans
CHUNK_STAGES = {"full": "full kernel (us)", "nobuild": "no table build (us)", "notiles": "no tile loop (us)",
                "noload": "no code loads (us)"}


def chunk_stages(folder=None) -> pd.DataFrame:
    """The chunk kernel at the 70B decode's fused launches, each with one stage left out (outputs wrong
    on purpose, timing only; the full kernel checked first): one row a GPU, layer, fused operation and
    plan, one column a variant, in microseconds (fastest of three interleaved passes, one process)."""
    rows = []
    for prov, probe, t in _probe_runs(folder, CHUNK_STAGE_PROBES, short=True):
        for r in t.to_dict("records"):
            rows.append(_chunk_case(prov, str(r["what"]).replace(" plain", ""), r["in_features"], r["out_features"], r.get("pre"),
                                    r.get("post"), r["plan"])
                        | {"part": CHUNK_STAGES.get(r["ablation"], r["ablation"]), "us": 1e3 * float(r["time_ms"]), "probe": probe})
    if not rows:
        return pd.DataFrame()
    out = pd.DataFrame(rows).pivot_table(index=["GPU", "layer", "in x out", "fused", "plan", "probe"], columns="part", values="us", sort=False)
    out = out[[c for c in CHUNK_STAGES.values() if c in out.columns]].reset_index()
    return out[[c for c in out.columns if c != "probe"] + ["probe"]]


ROWS_PROBES = "_runs/rows-probe-*.json"  # rows a block of the chunk kernel at the 70B shapes


def rows_probe(folder=None) -> pd.DataFrame:
    """The chunk kernel's rows a block at the 70B decode's fused launches (each plan checked first, then
    timed interleaved, fastest of three, one process): one row a GPU, layer and plan, with its grid's
    blocks and its time over the first plan's (the one the decode ran)."""
    rows = []
    for prov, probe, t in _probe_runs(folder, ROWS_PROBES, short=True):
        for what, g in t.groupby("what", sort=False):
            first = float(g["time_ms"].iloc[0])
            for r in g.to_dict("records"):
                rows.append(_chunk_case(prov, what, r["in_features"], r["out_features"], r.get("pre"), r.get("post"), r["plan"])
                            | {"blocks": int(r["blocks"]), "us": 1e3 * float(r["time_ms"]),
                               "over the decode's plan": float(r["time_ms"]) / first, "probe": probe})
    return pd.DataFrame(rows)


HSUM_PROBES = "_runs/hsum-probe-*.json"  # a code word's four lookups summed in fp16 (gemv.half_sum4) against 7126cd0


def hsum_probe(folder=None) -> pd.DataFrame:
    """The 8-warp chunk builds with a code word's four lookups summed in fp16 and widened once (the probe's
    commit) against 7126cd0's (each lookup widened to fp32 and summed there), at the decode's plans, in one
    process (fastest of three interleaved passes): one row a GPU, layer and plan, in microseconds."""
    rows = []
    for prov, probe, t in _probe_runs(folder, HSUM_PROBES, short=True):
        for keys, _, us in _chunk_variants(t):
            row = _chunk_case(prov, *keys)
            row |= {"fp32 sums, 7126cd0 (us)": us.get("7126cd0", np.nan), "fp16 sums (us)": us.get("new", np.nan)}
            rows.append(row | {"fp16 / fp32 sums": row["fp16 sums (us)"] / row["fp32 sums, 7126cd0 (us)"], "probe": probe})
    return pd.DataFrame(rows)


STATIC_SUMS_PROBES = "_runs/cluster-static-probe-*.json"  # 034c66f, a32db5e (static cluster sums), 90922cd's fetch


def _versions_probe(folder, pattern: str, labels: dict) -> pd.DataFrame:
    """A probe of versions of the chunk kernel timed at the same plans in one process: one row a GPU,
    layer and plan, a column of microseconds a version (``labels``: the probe's variant name -> column)."""
    rows = []
    for prov, probe, t in _probe_runs(folder, pattern, short=True):
        for keys, _, us in _chunk_variants(t):
            rows.append(_chunk_case(prov, *keys) | {col: us.get(v, np.nan) for v, col in labels.items()} | {"probe": probe})
    return pd.DataFrame(rows)


def static_sums_probe(folder=None) -> pd.DataFrame:
    """Three versions of the chunk kernel at the decode's plans, in one process (fastest of three
    interleaved passes): 034c66f (a cluster block's row sums in the dynamic shared memory past x; each
    code load its own index), a32db5e (those sums a static array) and the probe's commit (a tile's code
    loads off one 64-bit base, 90922cd). One row a GPU, layer and plan, in microseconds."""
    t = _versions_probe(folder, STATIC_SUMS_PROBES, {"034c66f": "034c66f (us)", "a32db5e": "static sums, a32db5e (us)",
                                                      "new": "one-base fetch (us)"})
    if t.empty:
        return t
    t.insert(len(t.columns) - 1, "a32db5e / 034c66f", t["static sums, a32db5e (us)"] / t["034c66f (us)"])
    t.insert(len(t.columns) - 1, "fetch / a32db5e", t["one-base fetch (us)"] / t["static sums, a32db5e (us)"])
    return t


FETCH_PROBES = "_runs/fetch-probe-*.json"  # a tile's code loads: a32db5e's, one burst (90922cd), two halves (de2bff3)


def fetch_probe(folder=None) -> pd.DataFrame:
    """The chunk kernel's code loads, three versions at the decode's plans in one process (fastest of
    three interleaved passes): a32db5e (each load its own index, spread by ptxas among the lookups), the
    probe's commit (one 64-bit base; ptxas issues the next tile's loads in one burst before the lookups)
    and that commit's addressing with the loads in two halves, each before half the lookups. One row a
    GPU, layer and plan, in microseconds."""
    t = _versions_probe(folder, FETCH_PROBES, {"a32db5e": "a32db5e (us)", "new": "one burst (us)", "fx": "two halves (us)"})
    if t.empty:
        return t
    t.insert(len(t.columns) - 1, "halves / burst", t["two halves (us)"] / t["one burst (us)"])
    t.insert(len(t.columns) - 1, "halves / a32db5e", t["two halves (us)"] / t["a32db5e (us)"])
    return t


C16_PROBES = "_runs/c16-probe-*.json"  # clusters of 9 to 16 chunks (non-portable) against the global finish


def cluster16_probe(folder=None) -> pd.DataFrame:
    """Clusters of more than 8 chunks (a non-portable cluster, which sm_90 runs once the kernel opts in)
    against the global finish the package's plan ran, one process (fastest of three interleaved passes,
    torch fp16 beside them): one row a GPU and layer, the global plan's time and the fastest cluster
    plan's. Plans the chunk kernel refused are left out (the probe keeps their errors)."""
    rows = []
    for prov, probe, t in _probe_runs(folder, C16_PROBES, short=True):
        if t.empty:
            continue
        for (what, n_in, n_out, M, pre, post), g in t.groupby(["what", "in_features", "out_features", "M", "pre", "post"], sort=False):
            glob, clus = g[g["variant"] == "global"], g[g["variant"] != "global"]
            if glob.empty or clus.empty:
                continue
            best = clus.loc[clus["time_ms"].idxmin()]
            gu, cu = 1e3 * float(glob["time_ms"].min()), 1e3 * float(best["time_ms"])
            rows.append(_chunk_case(prov, what, n_in, n_out, pre, post, glob["plan"].iloc[0]) |
                        {"M": int(M), "global finish (us)": gu, "fastest cluster plan": _chunk_plan_label(best["plan"]),
                         "cluster (us)": cu, "cluster / global": cu / gu, "probe": probe})
    return pd.DataFrame(rows)


M4_PROBES = "_runs/m4-probe-*.json"  # 4-bit (M = 4) on the chunk kernel (two M = 2 halves) against the table kernel


def m4_chunk_probe(folder=None) -> pd.DataFrame:
    """4-bit additive codes (M = 4, batch 1) on the chunk kernel, as two M = 2 halves, against the table
    kernel's plan from the additive table, in one process (fastest of three interleaved passes, torch
    fp16 timed beside them): one row a GPU and shape, the table plan's time and the fastest chunk plan's."""
    rows = []
    for prov, probe, t in _probe_runs(folder, M4_PROBES, short=True):
        if t.empty:
            continue
        t = t.assign(chunk=t["plan"].str.contains("'kernel': 'chunk'"))
        for (n_in, n_out), g in t.groupby(["in_features", "out_features"], sort=False):
            table, chunk = g[~g["chunk"]], g[g["chunk"]]
            if table.empty or chunk.empty:
                continue
            best = chunk.loc[chunk["time_ms"].idxmin()]
            fp16 = 1e3 * float(g["fp16_ms"].min())
            tu, cu = 1e3 * float(table["time_ms"].min()), 1e3 * float(best["time_ms"])
            rows.append({"GPU": gpu_label(prov.get("gpu", "")), "in x out": shape_label((int(n_in), int(n_out))),
                         "torch fp16 (us)": fp16, "table kernel (us)": tu, "chunk kernel (us)": cu,
                         "chunk plan": _chunk_plan_label(best["plan"]), "table: fp16 / it": fp16 / tu,
                         "chunk: fp16 / it": fp16 / cu, "probe": probe})
    return pd.DataFrame(rows)


SPLITS_PROBES = "_runs/splits-probe-*.json"  # the table kernel's K-split finish: sum_splits as committed, and whole groups unclamped


def splits_probe(folder=None) -> pd.DataFrame:
    """The table kernel's 4-bit plans with two forms of ``gemv.sum_splits`` (one process each, the form
    installed before any kernel compiled; checks first): every load's index clamped (as committed at the
    probe's commit) and whole groups of 32 slices unclamped with the clamped tail after. One row a GPU,
    shape and plan, in microseconds (fastest of three), torch fp16 timed beside each."""
    runs = [(prov, t) for prov, _, t in _probe_runs(folder, SPLITS_PROBES, short=True) if not t.empty]
    if not runs:
        return pd.DataFrame()
    t = pd.concat([t.assign(gpu=gpu_label(prov.get("gpu", "")), commit=str(prov.get("git_commit"))[:7]) for prov, t in runs])
    rows = []
    for (gpu, commit, n_in, n_out, M, plan), g, us in _chunk_variants(t, ("gpu", "commit", "in_features", "out_features", "M", "plan")):
        p = ast.literal_eval(plan)
        rows.append({"GPU": gpu, "in x out": shape_label((int(n_in), int(n_out))), "M": int(M),
                     "plan": f"{p['warps']} warps, {p['RB']} rows a block, K-split {p['ksplit']}",
                     "torch fp16 (us)": 1e3 * float(g["fp16_ms"].min()), "every load clamped (us)": us.get("head", np.nan),
                     "whole groups unclamped (us)": us.get("fix", np.nan),
                     "unclamped / clamped": us.get("fix", np.nan) / us.get("head", np.nan), "probe": commit})
    return pd.DataFrame(rows)


CHUNK_RUNS_PROBES = "_runs/chunk-runs-probe*.json"  # runs of chunks a block (tried and reverted; the code is in git history)


def chunk_runs_trial(folder=None) -> pd.DataFrame:
    """The chunk kernel with a run of chunks a block, tried and reverted: one row a GPU, shape, fused
    operation and plan, in microseconds (fastest of the probe's interleaved passes, one process), and
    each time over the fastest plan of a chunk a block timed beside it."""
    rows = []
    for prov, probe, t in _probe_runs(folder, CHUNK_RUNS_PROBES, short=True):
        if t.empty:
            continue
        t = t.assign(op=(t["pre"].fillna("") + " + " + t["post"].fillna("")).str.strip(" +").replace("", "plain")
                     if "pre" in t else "plain")
        for (n_in, n_out, op), g in t.groupby(["in_features", "out_features", "op"], sort=False):
            plans = [ast.literal_eval(p) for p in g["plan"]]
            single = [float(ms) for ms, p in zip(g["time_ms"], plans) if p.get("chunks", 1) == 1]
            if not single:
                continue
            for r, p in zip(g.to_dict("records"), plans):
                rows.append({"GPU": gpu_label(prov.get("gpu", "")), "in x out": shape_label((int(n_in), int(n_out))),
                             "operation": op, "plan": _chunk_plan_label(r["plan"]), "chunks a block": int(p.get("chunks", 1)),
                             "finish": "cluster" if p.get("cluster") else "global", "torch fp16 (us)": 1e3 * float(r["fp16_ms"]),
                             "time (us)": 1e3 * float(r["time_ms"]), "/ fastest of a chunk a block": float(r["time_ms"]) / min(single),
                             "probe": probe})
    return pd.DataFrame(rows)


PROGRAMMATIC_PROBES = "_runs/pdl-probe-*.json"  # the fused step launched programmatically and strictly in sequence


PROBE_MODEL = "7B 2-bit additive, LM head 4-bit K=16"  # the model of a probe whose provenance names none
PROGRAMMATIC_VARIANTS = "_runs/pdl-variants-*.json"  # which of the step's launches are programmatic, timed alternately


def _step_probe_id(prov: dict) -> dict:
    # The columns naming a fused-step probe: its GPU, model and commit.
    return {"GPU": gpu_label(prov.get("gpu", "")), "model": prov.get("model", PROBE_MODEL), "commit": str(prov.get("git_commit"))[:7]}


def programmatic_variants(folder=None) -> pd.DataFrame:
    """Which of the fused step's launches start before their predecessor finishes, one row a
    variant of a probe (median of three interleaved graph captures of 100 token replays, one
    process): its token time and that of the strictly serial step over it."""
    rows = []
    for _, prov, recs in _probe_files(folder, PROGRAMMATIC_VARIANTS):
        t = next((r for r in recs if r.get("kind") == "time" and "median_us" in r), None)
        if t is None or "serial" not in t["median_us"]:
            continue
        serial = float(t["median_us"]["serial"])
        for v, us in t["median_us"].items():
            rows.append({**_step_probe_id(prov), "launches": prov.get("variants", {}).get(v, v),
                         "token (us)": float(us), "serial / this": serial / float(us),
                         "same tokens": bool(t.get("same_tokens"))})
    return pd.DataFrame(rows)


def programmatic_probe(folder=None) -> pd.DataFrame:
    """The fused step with programmatic dependent launch against the same step launched strictly in
    sequence, one row a probe (its model in the provenance, else :data:`PROBE_MODEL`; one process): where its kernels let the next
    launch start, a token's wall time both ways (median of three interleaved graph captures of 100
    replays), the tok/s of 512 generated tokens both ways, and whether the two gave the same tokens and
    logits (bit for bit) and eager's tokens."""
    rows = []
    for name, prov, recs in _probe_files(folder, PROGRAMMATIC_PROBES):
        wall = next((r for r in recs if r.get("kind") == "time" and "pdl_median_us" in r), None)
        gen = {r["programmatic"]: r["tok_s"] for r in recs if r.get("kind") == "time" and "tok_s" in r}
        same = next((r for r in recs if r.get("kind") == "check" and "tokens_equal_pdl_serial" in r), None)
        if wall is None or same is None:
            continue
        rows.append({**_step_probe_id(prov), "next launch released": prov.get("dependents_released", "?"),
                     "token, serial (us)": float(wall["serial_median_us"]), "token, programmatic (us)": float(wall["pdl_median_us"]),
                     "serial / programmatic": float(wall["serial_median_us"] / wall["pdl_median_us"]),
                     "tok/s, serial": gen.get(False, float("nan")), "tok/s, programmatic": gen.get(True, float("nan")),
                     "same tokens and logits": bool(same["tokens_equal_pdl_serial"] and same["max_abs_logit_diff_pdl_serial"] == 0),
                     "tokens as eager": f"{same['tokens_matching_eager']}/32"})
    return pd.DataFrame(rows)


DUAL_STEP_PROBES = "_runs/dual-step-probe-*.json"  # the 4-bit step's fused GEMVs on lut alone and on lut or dual
DUAL_STEP_FAMILIES = {"lut": "lut only", "lut+dual": "lut or dual, the faster per operation"}


def dual_step_probe(folder=None) -> pd.DataFrame:
    """The 4-bit fused step with its fused GEMVs held to the lut kernel against lut or dual (each
    operation's faster family), one row a family of a probe (one process, the two steps' graphs
    replayed alternately, 100 tokens a round): the median token, lut-only's token over it, and where
    the two steps' greedy tokens first differ, with the top-two logit gap there in each."""
    rows = []
    for _, prov, recs in _probe_files(folder, DUAL_STEP_PROBES):
        times = [r for r in recs if r.get("kind") == "time"]
        check = next((r for r in recs if r.get("kind") == "check" and "first_mismatch" in r), None)
        lut = [r["token_us"] for r in times if r["family"] == "lut"]
        if not lut or check is None:
            continue
        base = float(np.median(lut))
        fm = check["first_mismatch"]
        gaps = "-" if fm is None else f"{check['top2_gap_at_mismatch_lut']:.3g} / {check['top2_gap_at_mismatch_lut_dual']:.3g}"
        for fam, label in DUAL_STEP_FAMILIES.items():
            us = [r["token_us"] for r in times if r["family"] == fam]
            if not us:
                continue
            rows.append({**_step_probe_id(prov), "fused GEMVs": label, "rounds": len(us), "token (us)": float(np.median(us)),
                         "lut only / this": base / float(np.median(us)),
                         "first differing token": "none" if fm is None else str(fm),
                         "top-2 logit gap there (lut / lut or dual)": gaps,
                         "max logit difference before it": float(check["max_abs_logit_diff_before_mismatch"])})
    return pd.DataFrame(rows)


CLUSTER_DECODE_AB = "_runs/cluster-decode-ab-*.json"  # the 2-bit decode with and without the chunk kernel's cluster plans
CLUSTER_RUNS = {  # a run's key in the A/B file -> what its fused step's plans were
    "7b-c8": "the carried plans: clusters of 8 at qkv, gate_up and o", "7b-global": "the same plans, global finish",
    "13b-global": "the carried plans: global finish", "13b-c16": "clusters of 10 chunks at qkv and gate_up",
    "13b-c16-first": "clusters of 10 chunks at qkv and gate_up (first run)",
    "70b-global": "the carried plans: global finish", "70b-c16": "a cluster of 16 chunks at qkv",
}


def cluster_decode_ab(folder=None) -> pd.DataFrame:
    """The 2-bit fused step with and without thread block clusters in its chunk plans, one row a decode
    run's fused-step row (each run its own process, 512 tokens): its launches (programmatic, or strictly
    serial), tok/s, torch fp16's in the same process, and where the run timed them, the step bound (the
    fused step's own kernels, each timed alone in CUDA graphs) and the share of it the decode reached.
    7B's "global" replaces its clusters of 8 by the same plans' global finish; 13B's and 70B's "c16" set
    the layers that a cluster of 10 or 16 chunks ran faster alone."""
    rows = []
    for _, prov, all_recs in _probe_files(folder, CLUSTER_DECODE_AB):
        runs: dict = {}
        for r in all_recs:  # each record names its decode process
            runs.setdefault(r["run"], []).append(r)
        for key, recs in runs.items():
            model = key.split("-", 1)[0]
            fp16 = next((r for r in recs if r.get("scheme") == "fp16"), None)
            for q in (r for r in recs if r.get("path") == "fused-step"):
                rows.append({"GPU": gpu_label(prov.get("gpu", "")), "model": f"Llama-2-{model[:-1]}{model[-1].upper()}",
                             "plans": CLUSTER_RUNS.get(key, key), "launches": "serial" if q.get("programmatic") is False else "programmatic",
                             "commit": str(prov.get("git_commit"))[:7], "tok/s": float(q["tok_s"]),
                             "torch fp16 tok/s": float(fp16["tok_s"]) if fp16 else np.nan,
                             "step bound tok/s": float(q.get("step_implied_tok_s") or np.nan),
                             "share of step bound": float(q.get("fraction_of_step_bound") or np.nan)})
    t = pd.DataFrame(rows)
    if t.empty:
        return t
    size = t["model"].str.extract(r"(\d+)B")[0].astype(int)
    return t.assign(_size=size).sort_values(["_size", "plans", "commit"], kind="stable").drop(columns="_size").reset_index(drop=True)


# The 4-bit step (lut or dual GEMVs) two ways in one process: per probe file pattern, its variants
# (the records' "family") in order, the first the baseline
DUAL_LAUNCH_PROBES = {
    "_runs/dual-early-probe-*.json": {"serial": "dual launched serially",
                                      "early": "dual launched programmatically (table built, then the wait)"},
    "_runs/dual-oproj-probe-*.json": {"o on lut": "o_proj on its tuned lut plan",
                                      "o on dual": "o_proj on dual, launched programmatically"},
}


def dual_launch_probe(folder=None) -> pd.DataFrame:
    """The 4-bit fused step built two ways in one process, its two graphs replayed alternately (100
    tokens a round): the dual kernel launched serially against programmatically, and o_proj on its
    tuned lut plan against dual (:data:`DUAL_LAUNCH_PROBES`). One row a variant: the median token,
    the probe's first variant's over it, and whether the two steps gave the same greedy tokens, with
    their largest logit difference."""
    rows = []
    for pattern, labels in DUAL_LAUNCH_PROBES.items():
        for _, prov, recs in _probe_files(folder, pattern):
            check = next((r for r in recs if r.get("kind") == "check"), None)
            us = {f: [r["token_us"] for r in recs if r.get("kind") == "time" and r.get("family") == f] for f in labels}
            if check is None or not all(us.values()):
                continue
            base = float(np.median(next(iter(us.values()))))
            for f, label in labels.items():
                rows.append({**_step_probe_id(prov), "variant": label, "rounds": len(us[f]), "token (us)": float(np.median(us[f])),
                             "first / this": base / float(np.median(us[f])), "same greedy tokens": bool(check["tokens_equal"]),
                             "max logit difference": float(check["max_abs_logit_diff"])})
    return pd.DataFrame(rows)


ADDITIVE_STREAM_SKELETON = "_runs/additive-stream-skeleton-*.json"  # the streaming kernel with parts left out
STREAM_PARTS = {"full": "full kernel (us)", "nobuild": "no table build (us)", "nolook": "no lookups (us)",
                "skeleton": "neither: codes streamed, barriers, sums (us)", "empty": "empty launch (us)"}


def additive_stream_skeleton(folder=None) -> pd.DataFrame:
    """The streaming kernel timed with parts of it left out (wrong outputs, timing only), one row a GPU,
    shape, K-split and code-slot count, one column a variant, in microseconds, beside fp16."""
    rows = []
    for prov, _, t in _probe_runs(folder, ADDITIVE_STREAM_SKELETON):
        for r in t.to_dict("records"):
            rows.append({"GPU": gpu_label(prov.get("gpu", "")), "in x out": shape_label((int(r["in_features"]), int(r["out_features"]))),
                         "torch fp16 (us)": float(r["fp16_us"]), "K-split": int(r["ksplit"]), "code slots": int(r["slots"]),
                         "part": STREAM_PARTS.get(r["probe"], r["probe"]), "us": float(r["time_us"])})
    if not rows:
        return pd.DataFrame()
    d = pd.DataFrame(rows)
    out = d.pivot_table(index=["GPU", "in x out", "torch fp16 (us)", "K-split", "code slots"], columns="part", values="us", sort=False)
    return out[[c for c in STREAM_PARTS.values() if c in out.columns]].reset_index()


def vq_run_notes(folder=None) -> pd.DataFrame:
    """What the provenance of each run the chapter shows says went wrong or was left out (failed
    sweeps, skipped peers, a run stopped part way)."""
    rows = []
    root = _root(folder)
    for f in sorted(load_vq(folder)["file"].unique()):  # every run the chapter shows a part of
        path = root / f
        prov, _ = results.read(path)
        for key in sorted(prov):
            if key.endswith("_failures") or key in ("failures", "aqlm_package", "cuda_cpp_error", "partial"):
                v = prov[key]
                if v in (None, [], ""):
                    continue
                rows.append({"file": f, "GPU": gpu_label(prov.get("gpu", "")), "what": key,
                             "note": "; ".join(v) if isinstance(v, list) else str(v)})
    return pd.DataFrame(rows, columns=["file", "GPU", "what", "note"])


def fig_additive(df: pd.DataFrame) -> Figure:
    """Speedup over fp16 by shape for each additive kernel, one panel a GPU."""
    d = df[(df["grid"] == "additive") & df["time_ms"].notna()].copy()
    d["series"] = d["kernel"].map(lambda k: ADDITIVE_KERNELS.get(k, k)) + ", " + d["scheme"].astype(str)
    gpus = _gpus(d)
    shapes = sorted({(int(a), int(b)) for a, b in zip(d["in_features"], d["out_features"])}, key=lambda s: s[0] * s[1])
    series = sorted(d["series"].unique())
    with _style():
        fig = Figure(figsize=(max(9.0, 6.2 * len(gpus)), 4.8), layout="constrained")
        axes = np.atleast_1d(fig.subplots(1, len(gpus), sharey=True))
        w = 0.8 / max(1, len(series))
        for ax, gpu in zip(axes, gpus):
            g = d[d["gpu"] == gpu]
            for i, s in enumerate(series):
                v = g[g["series"] == s].set_index(["in_features", "out_features"])["speedup"]
                ax.bar(np.arange(len(shapes)) + (i - (len(series) - 1) / 2) * w, [v.get(sh, np.nan) for sh in shapes], w,
                       label=s, color=f"C{i}")
            ax.axhline(1, color="0.3", ls=":", lw=1)
            ax.set_xticks(range(len(shapes)), [shape_label(s) for s in shapes], rotation=30, ha="right", fontsize=8)
            ax.set_title(gpu_label(gpu))
            ax.set_xlabel("in x out")
        axes[0].set_ylabel("speedup over torch fp16")
        _shared_legend(fig, axes, ncols=2)
    return fig


STAGING_PROBES = "_runs/stage-probe-*.json"  # staging microbenchmark: a grid of blocks that only stage
STAGING_METHODS = {  # the probe's variant -> how its blocks copy
    "ca": "cp.async, 16 B a thread (the split kernel's)", "ca rotated": "cp.async, each block's start rotated",
    "ca distinct": "cp.async, a buffer of its own a block", "cg": "cp.async.cg (past L1)",
    "bulk": "bulk copy (TMA), 4 KiB pieces", "bulk cluster 2": "bulk copy multicast, clusters of 2",
    "bulk cluster 4": "bulk copy multicast, clusters of 4", "bulk cluster 8": "bulk copy multicast, clusters of 8",
}


def staging_costs(folder=None) -> pd.DataFrame:
    """The staging microbenchmark: one row a GPU, bytes a block and grid size, one column a copy method: the
    graph-replayed time of a launch whose blocks only copy that many bytes of one L2-warm buffer into shared
    memory and wait (0 bytes: the launch alone). Each row's every method was checked for the staged data."""
    rows = []
    for name, prov, recs in _probe_files(folder, STAGING_PROBES):
        gpu = gpu_label(prov.get("gpu", ""))
        for r in recs:
            if r.get("ok") is False:
                raise ValueError(f"{name}: {r['variant']} staged wrong data at {r['S']} bytes, {r['G']} blocks")
            rows.append({"GPU": gpu, "KiB a block": int(r["S"]) // 1024, "blocks": int(r["G"]),
                         "method": STAGING_METHODS.get(r["variant"], r["variant"]) + " (us)", "us": float(r["us"])})
    d = pd.DataFrame(rows)
    if d.empty:
        return d
    out = d.pivot_table(index=["GPU", "KiB a block", "blocks"], columns="method", values="us", sort=False)
    return out[[m + " (us)" for m in STAGING_METHODS.values() if m + " (us)" in out]].reset_index().rename_axis(columns=None)


def fig_staging(folder=None) -> Figure:
    """Launch time against bytes staged a block, one line a copy method, one panel a GPU (row) and grid size (column)."""
    d = staging_costs(folder)
    if d.empty:
        raise ValueError(f"no staging probe recorded ({STAGING_PROBES})")
    gpus, grids = list(dict.fromkeys(d["GPU"])), sorted(d["blocks"].unique())
    methods = [c for c in d.columns if c.endswith(" (us)")]  # staging_costs' method columns, in its order
    with _style():
        fig = Figure(figsize=(4.2 * len(grids), 3.4 * len(gpus) + 0.8), layout="constrained")
        axes = np.atleast_2d(fig.subplots(len(gpus), len(grids), sharey=True, squeeze=False))
        for row, gpu in zip(axes, gpus):
            for ax, G in zip(row, grids):
                g = d[(d["GPU"] == gpu) & (d["blocks"] == G)].sort_values("KiB a block")
                for i, m in enumerate(methods):
                    v = g.dropna(subset=[m])
                    ax.plot(v["KiB a block"], v[m], marker="o", ms=3, color=f"C{i}", ls="--" if "multicast" in m else "-",
                            label=m.removesuffix(" (us)"))
                ax.set_title(f"{gpu}, {G} blocks")
            row[0].set_ylabel("µs a launch (CUDA-graph replay)")
        for ax in axes[-1]:
            ax.set_xlabel("KiB staged a block")
        _shared_legend(fig, axes.ravel(), ncols=2)
    return fig


CLUSTER_CODEBOOK_PROBES = "_runs/dsmem-probe-*.json"  # a main codebook shared by a thread block cluster


def cluster_codebook_probe(folder=None) -> pd.DataFrame:
    """The skeleton of the smallest residual layer (staging, then each thread's random 16-byte gathers of the
    main codebook; no multiply-adds, no finish) done by clusters of CS blocks: every block staging the whole
    codebook and gathering locally, or 1/CS of it and gathering from the entry's owner through distributed
    shared memory. One row a GPU and cluster size; raises where a variant's gathered sums were wrong."""
    rows = []
    for name, prov, recs in _probe_files(folder, CLUSTER_CODEBOOK_PROBES):
        for r in recs:
            if not r.get("ok"):
                raise ValueError(f"{name}: cluster size {r['CS']}, {r['stage']}: the gathered sums were wrong")
            whole = r["stage"].startswith("whole")
            rows.append({"GPU": gpu_label(prov.get("gpu", "")), "blocks a cluster": int(r["CS"]),
                         "gathers a thread": int(r["gathers_a_thread"]),
                         "col": "whole codebook a block, local gathers (us)" if whole else "1 / cluster of it a block, gathers across the cluster (us)",
                         "us": float(r["us"])})
    d = pd.DataFrame(rows)
    if d.empty:
        return d
    return d.pivot_table(index=["GPU", "blocks a cluster", "gathers a thread"], columns="col", values="us",
                         sort=False).reset_index().rename_axis(columns=None)


RESIDUAL_PARTS_PROBES = "_runs/residual-parts-probe-*.json"  # parts of the main codebook a block (reverted)


def _split_trial(folder, pattern: str, key: str, what: str, plan) -> pd.DataFrame:
    """A probe of one change to the residual split kernel: one row a probe, configuration and shape: torch fp16,
    the fastest plan without the change and the fastest with it (record key ``key``, described by ``plan``),
    all timed in the probe's process (every plan twice, the better kept); "<what> / without" above 1 is slower."""
    rows = []
    for prov, probe, t in _probe_runs(folder, pattern, short=True):
        for r in t.to_dict("records"):
            plain, new = r["best_plain"], r[key]
            rows.append({"probe": probe, "GPU": gpu_label(prov.get("gpu", "")), "config": f"{int(r['Nm'])} + {int(r['Nr'])}",
                         "in x out": shape_label((int(r["n_in"]), int(r["n_out"]))),
                         "torch fp16 (us)": float(np.median(r["fp16_us"])), f"without {what} (us)": float(plain["best_us"]),
                         f"with {what}, fastest (us)": float(new["best_us"]), f"fastest {what} plan": plan(new),
                         f"{what} / without": float(new["best_us"]) / float(plain["best_us"])})
    return pd.DataFrame(rows)


def residual_parts_trial(folder=None) -> pd.DataFrame:
    """The split kernel with the main codebook cut into parts, one a block (tried and reverted): see :func:`_split_trial`."""
    return _split_trial(folder, RESIDUAL_PARTS_PROBES, "best_parts", "parts",
                        lambda p: f"{p['parts']} parts, K-split {p['ksplit']}, {p['warps']} warps, rc {p['rc']}")


RESIDUAL_CLUSTER_PROBES = "_runs/residual-cluster-1024out-*.json"  # the K-split as a thread block cluster (reverted)
RESIDUAL_LANES_PROBES = "_runs/residual-lanes-probe-*.json"  # the lane split (kept)


def residual_cluster_trial(folder=None) -> pd.DataFrame:
    """The split kernel's K-split as a thread block cluster, its partials summed through distributed shared
    memory (tried at the layers of 1024 outputs and reverted): see :func:`_split_trial`."""
    return _split_trial(folder, RESIDUAL_CLUSTER_PROBES, "best_cluster", "a cluster",
                        lambda p: f"clusters of {p['cluster']}, {p['warps']} warps, rc {p['rc']}")


def residual_lanes_trial(folder=None) -> pd.DataFrame:
    """The split kernel's lane split: a warp's lanes in 2 or 4 groups of rows, each group a chunk of the warp's
    step, one K-slice (kept): see :func:`_split_trial`."""
    return _split_trial(folder, RESIDUAL_LANES_PROBES, "best_lanes", "a lane split",
                        lambda p: f"{p['lanes']} groups of {32 // p['lanes']} rows, {p['warps']} warps, rc {p['rc']}")


RESIDUAL_BUFFER_PROBES = {"_runs/residual-db-probe-*.json": "every table and split plan the tuner times",
                          "_runs/residual-db-sameg-*.json": "the table at G = 2, 4, 8; two buffers at G = 4"}


def residual_buffers_trial(folder=None) -> pd.DataFrame:
    """The tensor-core table kernel with two table buffers (one barrier a step; tried and reverted, session 64),
    one row a probe, configuration and shape, all timed in the probe's process: the fastest plan with one table
    buffer (v3) and its G, one buffer at the two-buffer plans' G where the probe timed it, the fastest two-buffer
    plan and its G, and the split kernel's fastest plan where the probe timed it. "two / one" above 1 is slower."""
    rows = []
    for pattern, what in RESIDUAL_BUFFER_PROBES.items():
        for prov, probe, t in _probe_runs(folder, pattern, short=True):
            if t.empty:
                continue
            for (Nm, Nr, n_in, n_out), g in t.groupby(["Nm", "Nr", "n_in", "n_out"], sort=False):
                tab = g[g["variant"] == "table"]
                one, two = tab[tab["buffers"] == 1], tab[tab["buffers"] == 2]
                if one.empty or two.empty:
                    continue
                b1, b2 = one.loc[one["us"].idxmin()], two.loc[two["us"].idxmin()]
                same = one.loc[one["G"] == b2["G"], "us"].min()  # NaN where the probe did not time that G with one buffer
                split = g.loc[g["variant"] == "split", "us"].min()
                rows.append({"probe": probe, "timed": what, "GPU": gpu_label(prov.get("gpu", "")),
                             "codebooks": f"{int(Nm)}+{int(Nr)}", "in x out": shape_label((int(n_in), int(n_out))),
                             "torch fp16 (us)": float(g["fp16_us"].iloc[0]),
                             "one buffer, fastest (us)": float(b1["us"]), "its G": int(b1["G"]),
                             "one buffer, two-buffer G (us)": float(same),
                             "two buffers, fastest (us)": float(b2["us"]), "G": int(b2["G"]),
                             "two / one, same G": float(b2["us"]) / float(same),
                             "two / one, fastest": float(b2["us"]) / float(b1["us"]),
                             "split, fastest (us)": float(split)})
    return pd.DataFrame(rows)


# The residual table kernel's K-split finish (session 65): three probes, each timing its variants in one process.
RESIDUAL_FINISH_PROBES = ("_runs/residual-fin-probe-*.json", "_runs/residual-rb-probe-*.json", "_runs/residual-fan-probe-*.json",
                          "_runs/residual-spread-probe-*.json")
TABLE_FINISH_V3 = "v3: 4-byte loads, 1 slice a round"
TABLE_FINISH_WIDE = "16-byte loads, 4 slices a round"
TABLE_FINISH_WIDE8 = "16-byte loads, 8 slices a round"
TABLE_FINISH_TWO = "two levels (runs of 4)"
TABLE_FINISH_SPREAD = "spread over the row-group's blocks"
TABLE_FINISHES = (TABLE_FINISH_V3, TABLE_FINISH_WIDE, TABLE_FINISH_WIDE8, TABLE_FINISH_TWO, TABLE_FINISH_SPREAD)


def _finish_variant(r: dict) -> str | None:
    """A finish probe record's variant (with ", RB 7" for row-groups of 3584 rows), timing or timeline;
    "split" for the split kernel's plan; None for what no variant names."""
    if r.get("variant") == "split":
        return "split"
    rb = r.get("RB")
    if rb is None or (isinstance(rb, float) and np.isnan(rb)):
        m = re.search(r"'RB': (\d+)", str(r.get("plan", "")))
        rb = int(m.group(1)) if m else 8
    finish = r.get("finish", {True: "wide", False: "rows"}.get(r.get("wide")))  # (the first probe's timelines say "wide")
    if finish == "rows":
        v = TABLE_FINISH_V3
    elif finish == "spread":
        v = TABLE_FINISH_SPREAD
    elif finish == "wide" or r.get("finish_loads") == 8 or r.get("fanin") == 64:
        v = TABLE_FINISH_WIDE  # (fanin 64: one level for every K-split the probe timed)
    elif r.get("finish_loads") == 16:
        v = TABLE_FINISH_WIDE8
    elif r.get("fanin") == 4:
        v = TABLE_FINISH_TWO
    else:
        return None
    return v + (", RB 7" if int(rb) == 7 else "")


def _finish_probe_runs(folder, kind: str = "time"):
    """:func:`_probe_runs` over the finish probes (:data:`RESIDUAL_FINISH_PROBES`), oldest first within each."""
    for pattern in RESIDUAL_FINISH_PROBES:
        yield from _probe_runs(folder, pattern, short=True, kind=kind)


def residual_finish_trial(folder=None) -> pd.DataFrame:
    """The table kernel's K-split finish variants, one row a probe, codebook pair and shape, all timed in
    the probe's process (CUDA-graph replays over L2-rotated words, median of three interleaved rounds):
    each variant's fastest K-split in us, the split kernel's plan beside them, torch fp16, and the fastest
    variant's speedup over fp16. Blank where a probe did not time a variant."""
    rows = []
    for prov, label, t in _finish_probe_runs(folder):
        if t.empty:
            continue
        t["what"] = [_finish_variant(r) for r in t.to_dict("records")]
        t = t[t["what"].notna()]
        for (Nm, Nr, n_in, n_out), g in t.groupby(["Nm", "Nr", "n_in", "n_out"], sort=False):
            row = {"probe": label, "GPU": gpu_label(prov.get("gpu", "")), "codebooks": f"{int(Nm)}+{int(Nr)}",
                   "in x out": shape_label((int(n_in), int(n_out))), "torch fp16 (us)": float(g["fp16_us"].iloc[0])}
            best = g.groupby("what")["us"].min()
            row |= {w: float(best[w]) for w in best.index}
            table = best.drop("split", errors="ignore")
            row["fastest table variant x fp16"] = row["torch fp16 (us)"] / float(table.min()) if len(table) else np.nan
            rows.append(row)
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    order = [v + rb for v in TABLE_FINISHES for rb in ("", ", RB 7")] + ["split"]
    lead = ["probe", "GPU", "codebooks", "in x out", "torch fp16 (us)"]
    return out[lead + [c for c in order if c in out] + ["fastest table variant x fp16"]]


def residual_timelines(folder=None, shape=(4096, 28672), codebooks=(4096, 256)) -> list[tuple[str, pd.DataFrame]]:
    """The finish probes' block timelines (:meth:`trapetum.residual.ResidualGemv.timeline`) of one shape and
    codebook pair, oldest first: (a label of the probe and variant, a DataFrame a row a block, times in us)."""
    out = []
    for _, label, t in _finish_probe_runs(folder, "timeline"):
        for r in t.to_dict("records"):
            what = _finish_variant(r)
            if (r["n_in"], r["n_out"]) != tuple(shape) or (r["Nm"], r["Nr"]) != tuple(codebooks) or what is None:
                continue
            out.append((f"{what} ({label.split()[0]})", _timeline_blocks(r)))
    return out


def _timeline_blocks(r: dict) -> pd.DataFrame:
    """A timeline record's blocks, a row a block, times in us."""
    b = pd.DataFrame(r["blocks"])
    if "summed" in b:  # the first probe's: a block summed its row-group's K-slices or not
        b["sums"] = np.where(b.pop("summed"), 2, 0)
    for c in ("start", "prologue", "steps", "finish"):
        b[c] = b[c] / 1e3
    return b


def residual_finish_runs(folder=None, gpu: str = "NVIDIA H200", commits=("57969e4", "3ef86cc", "a1128cf"), Nm: int = 4096,
                         Nr: int = 256, min_out: int = 14336) -> pd.DataFrame:
    """Our kernel's time (us) at the grid's layers of at least ``min_out`` outputs, one column a recorded run
    of one of ``commits`` on ``gpu`` (the table kernel's finishes of session 65: 16-byte loads; RB = 7 and
    two levels with a round's loads one after another; those loads issued together and one level or two
    tuned), and torch fp16 of the newest of those runs. Each run tuned its own plans."""
    d = load_vq_runs(folder, "residual")
    if d.empty:
        return pd.DataFrame()
    d = d[d["time_ms"].notna() & (d["gpu"] == gpu) & (d["main_centroids"].astype(int) == Nm)
          & (d["residual_centroids"].astype(int) == Nr) & (d["out_features"].astype(int) >= min_out)]
    d = d[d["git_commit"].astype(str).str[:7].isin(commits)]
    if d.empty:
        return pd.DataFrame()
    d = d.assign(shape=[shape_label((int(a), int(b))) for a, b in zip(d["in_features"], d["out_features"])],
                 run=d["git_commit"].astype(str).str[:7] + " " + d["date"].astype(str).str[11:16], us=d["time_ms"] * 1e3)
    order = d.groupby("run")["date"].min().sort_values().index.tolist()
    shapes = d.sort_values(["out_features", "in_features"])["shape"].unique()
    out = d.pivot_table(index="shape", columns="run", values="us").reindex(index=shapes, columns=order)
    newest = d[d["run"] == order[-1]].set_index("shape")["fp16_ms"] * 1e3
    out.insert(0, f"torch fp16, {order[-1]} (us)", newest.reindex(shapes))
    out.columns = [c if c.startswith("torch") else f"ours, {c} (us)" for c in out.columns]
    return out.reset_index().rename(columns={"shape": "in x out"})


RESIDUAL_BANK_PROBES = "_runs/residual-bank-probe-*.json"  # the banked table (v6) against v3 and split, session 66


def _bank_variant(r: dict) -> str:
    if r.get("variant") == "split":
        return "split"
    what = {"mma": "v3 tensor-core table", "banked": "v6 banked fp16 table"}[r["build"]]
    return what + (", RB 7" if int(r["RB"]) == 7 else "") + (", two levels" if r.get("fanin") else "")


def residual_bank_trial(folder=None) -> pd.DataFrame:
    """The banked fp16 table (v6) beside the v3 table and the split kernel's plan, one row a probe, codebook
    pair and shape, all timed in the probe's process (CUDA-graph replays over L2-rotated words, each layout
    its own copies; median of three interleaved rounds), in us; torch fp16 of that process, and the fastest
    v6 plan's time over the fastest v3 plan's."""
    rows = []
    for prov, label, t in _probe_runs(folder, RESIDUAL_BANK_PROBES, short=True):
        if t.empty:
            continue
        t["what"] = [_bank_variant(r) for r in t.to_dict("records")]
        for (Nm, Nr, n_in, n_out), g in t.groupby(["Nm", "Nr", "n_in", "n_out"], sort=False):
            best = g.groupby("what", sort=False)["us"].min()
            v3 = best[[w for w in best.index if w.startswith("v3")]].min()
            v6 = best[[w for w in best.index if w.startswith("v6")]].min()
            rows.append({"probe": label, "GPU": gpu_label(prov.get("gpu", "")), "codebooks": f"{int(Nm)}+{int(Nr)}",
                         "in x out": shape_label((int(n_in), int(n_out))), "torch fp16 (us)": float(g["fp16_us"].iloc[0])}
                        | {w: float(v) for w, v in best.items()}
                        | {"fastest v6 / fastest v3": v6 / v3, "fastest v6 x fp16": float(g["fp16_us"].iloc[0]) / v6})
    return pd.DataFrame(rows)


def residual_bank_timelines(folder=None, shape=(4096, 28672), codebooks=(4096, 256)) -> list[tuple[str, pd.DataFrame]]:
    """The banked-table probes' block timelines of one shape and codebook pair (as :func:`residual_timelines`)."""
    out = []
    for _, label, t in _probe_runs(folder, RESIDUAL_BANK_PROBES, short=True, kind="timeline"):
        for r in t.to_dict("records"):
            if (r["n_in"], r["n_out"]) != tuple(shape) or (r["Nm"], r["Nr"]) != tuple(codebooks):
                continue
            what = _bank_variant(r | {"RB": 7 if "'RB': 7" in r["plan"] else 8})  # (a timeline record names its plan only)
            out.append((f"{what} ({label.split()[0]})", _timeline_blocks(r)))
    return out


NCU_RESIDUAL_BANK = {"v3 tensor-core table, RB 7": "_runs/ncu/residual-v3rb7-*-h200.txt",
                     "v6 banked fp16 table, RB 7": "_runs/ncu/residual-banked-*-h200.txt"}


def residual_bank_ncu(folder=None) -> pd.DataFrame:
    """Nsight Compute's summary of one launch of each table at 4096 x 28672 (4096+256, H200; a standalone launch,
    caches flushed between ncu's passes): duration, instructions, cycles between a warp's instructions, and the
    bank conflicts ncu reports for shared loads and stores (the average ways a request)."""
    rows = []
    for what, pattern in NCU_RESIDUAL_BANK.items():
        for f in sorted(_root(folder).glob(pattern)):
            txt = f.read_text()

            def num(label):
                m = re.search(rf"{label}\s+\S+\s+([\d,.]+)", txt)
                return float(m.group(1).replace(",", "")) if m else np.nan

            def ways(kind):
                m = re.search(rf"on average a ([\d.]+) - way bank\s+conflict across all (\d+) shared {kind} requests", txt.replace("\n", " "))
                return (float(m.group(1)), int(m.group(2))) if m else (np.nan, np.nan)

            (lw, lr), (sw, sr) = ways("load"), ways("store")
            rows.append({"kernel": what, "file": f.name, "duration (us)": num("Duration"),
                         "executed instructions": num("Executed Instructions"),
                         "warp cycles per issued instruction": num("Warp Cycles Per Issued Instruction"),
                         "shared load requests": lr, "load bank conflict (ways)": lw,
                         "shared store requests": sr, "store bank conflict (ways)": sw})
    return pd.DataFrame(rows)


RESIDUAL_BANK_VARIANT_PROBES = "_runs/residual-banked-variant-probe-*.json"  # changes to v6 timed against it, sessions 67-68
BANK_VARIANTS = {"v7": "v7: fp16 pair sums, x prescaled (reverted)", "pre": "x prescaled before the build (kept)",
                 "b32": "build: 32-bit byte offsets, advanced a tile (kept)",
                 "loop": "steps in a loop over their fields' period (kept at G = 16; G = 8 stays unrolled)"}
BANK_BASELINES = ("v6", "main")  # the version a probe's change was timed against


def residual_bank_variants(folder=None) -> pd.DataFrame:
    """Changes to the banked table (v6) timed against the kernel before them in one process (each its own L2-rotated
    copies of the skewed words, CUDA-graph replays, interleaved rounds, median), one row a probe, shape and plan:
    both times in us and their ratio (below 1: the change is faster), with torch fp16 of that process."""
    rows = []
    for prov, label, t in _probe_runs(folder, RESIDUAL_BANK_VARIANT_PROBES, short=True):
        if t.empty:
            continue
        for (Nm, Nr, n_in, n_out, RB, ks), g in t.groupby(["Nm", "Nr", "n_in", "n_out", "RB", "ksplit"], sort=False):
            us = g.set_index("version")["us"]
            base = next(v for v in us.index if v in BANK_BASELINES)
            change = next(v for v in us.index if v != base)
            rows.append({"probe": label, "GPU": gpu_label(prov.get("gpu", "")), "change": BANK_VARIANTS.get(change, change),
                         "codebooks": f"{int(Nm)}+{int(Nr)}", "in x out": shape_label((int(n_in), int(n_out))),
                         "plan": f"RB {int(RB)}, K-split {int(ks)}", "torch fp16 (us)": float(g["fp16_us"].iloc[0]),
                         "before (us)": float(us[base]), "changed (us)": float(us[change]), "changed / before": float(us[change] / us[base])})
    return pd.DataFrame(rows)


RESIDUAL_BANK_WALK_PROBES = "_runs/residual-banked-walk-probe-*.json"  # session 69, tried and reverted (branch banked-walk)


def residual_bank_walk(folder=None) -> pd.DataFrame:
    """Walking banked blocks (a block builds one step's table and walks several row-groups over it; the K-split
    is then every step, its partials summed in two levels), tried and reverted: one row a probe process, layer
    and RB, the plan without walking beside the walking one with the faster of its finishes, both timed in that
    process (interleaved rounds, median, L2-rotated copies), with torch fp16 of that process."""
    rows = []
    for prov, label, t in _probe_runs(folder, RESIDUAL_BANK_WALK_PROBES, short=True):
        if t.empty:
            continue
        for (Nm, Nr, n_in, n_out, RB), g in t.groupby(["Nm", "Nr", "n_in", "n_out", "RB"], sort=False):
            one, walk = g[g["version"] == "one"], g[g["version"] != "one"]
            if one.empty or walk.empty:
                continue
            w = walk.loc[walk["us"].idxmin()]
            groups = math.ceil(math.ceil(int(n_out) / 32) / (16 * int(RB)))  # 32-row blocks, 16 warps of RB each a row-group
            rows.append({"probe": label, "GPU": gpu_label(prov.get("gpu", "")), "codebooks": f"{int(Nm)}+{int(Nr)}",
                         "in x out": shape_label((int(n_in), int(n_out))), "RB": int(RB), "torch fp16 (us)": float(g["fp16_us"].iloc[0]),
                         "a block a row-group (us)": float(one["us"].iloc[0]), "its K-split": int(one["ksplit"].iloc[0]),
                         "walking (us)": float(w["us"]), "row-groups a block": math.ceil(groups / int(w["blocks"])),
                         "finish runs of": int(w["fanin"]), "walking / a block a row-group": float(w["us"] / one["us"].iloc[0])})
    return pd.DataFrame(rows)


RESIDUAL_BANK_G8_PROBES = "_runs/residual-banked-g8-build-probe-*.json"


def residual_bank_g8(folder=None) -> pd.DataFrame:
    """The banked table with 8 groups a step (8192 main centroids, codebooks read through L1) before and after a
    change to its build, beside the split kernel's heuristic plan, one process (interleaved rounds, median, L2-rotated
    copies): one row a probe and layer. *after* is the probe's commit at its best RB; *before* the older build at
    that RB where the probe timed it there (else its first plan); times in us, speedups over torch fp16 of that process."""
    rows = []
    for prov, label, t in _probe_runs(folder, RESIDUAL_BANK_G8_PROBES, short=True):
        if t.empty:
            continue
        for (Nm, Nr, n_in, n_out), g in t.groupby(["Nm", "Nr", "n_in", "n_out"], sort=False):
            b, split = g[g["build"] == "banked"], g[g["variant"] == "split"]
            new, old = b[b["version"] == "new"], b[b["version"] != "new"]
            if new.empty or old.empty or split.empty:
                continue
            best = new.loc[new["us"].idxmin()]
            same = old[old["RB"] == best["RB"]]
            before = (same if len(same) else old).iloc[0]
            fp16, split_us = float(g["fp16_us"].iloc[0]), float(split["us"].iloc[0])
            rows.append({"probe": label, "GPU": gpu_label(prov.get("gpu", "")), "codebooks": f"{int(Nm)}+{int(Nr)}",
                         "in x out": shape_label((int(n_in), int(n_out))), "torch fp16 (us)": fp16,
                         "before (us)": float(before["us"]), "before: build, RB": f"{before['version']}, RB {int(before['RB'])}",
                         "after, best RB (us)": float(best["us"]), "its RB": int(best["RB"]),
                         "after / before": float(best["us"]) / float(before["us"]), "split, heuristic plan (us)": split_us,
                         "after: speedup over fp16": fp16 / float(best["us"]), "split: speedup over fp16": fp16 / split_us})
    return pd.DataFrame(rows)


NCU_RESIDUAL_STALLS = {"v3 tensor-core table, RB 7": "_runs/ncu/residual-stalls-v3rb7-*-h200.txt",
                       "v6 banked fp16 table, RB 7": "_runs/ncu/residual-stalls-banked-*-h200.txt",
                       "v6, 32-bit build offsets, RB 7": "_runs/ncu/residual-stalls-b32build-*-h200.txt",
                       "v6, steps in a loop, RB 7": "_runs/ncu/residual-stalls-loop-*-h200.txt"}
EXECUTED = "executed warp instructions (millions)"
STALL_REASON = "stall reason (warps per issued instruction)"


def _flushed_and_warm(layer: str, shape: str, kernels: tuple) -> dict:
    """Column names to globs of ncu reports of each (name, file tag) kernel at one layer, read with ncu's cache
    flush and without: ``_runs/ncu/residual-<layer>-<tag>-<shape>-<flushed|warm>-<commit>-h200.txt``."""
    return {f"{kernel}, caches {mode}": f"_runs/ncu/residual-{layer}-{tag}-{shape}-{mode}-*-h200.txt"
            for kernel, tag in kernels for mode in ("flushed", "warm")}


NCU_SMALL_STALLS = _flushed_and_warm("small", "1024x14336", (("split (8192+512)", "split-8192-512"),
                                                             ("banked RB 2 (4096+256)", "banked-4096-256")))
# The large layer's two banked plans (RB 7), profiled both ways at one commit (session 70)
NCU_LARGE_STALLS = _flushed_and_warm("large", "4096x28672", (("banked G = 16 (4096+256)", "banked16-4096-256"),
                                                             ("banked G = 8 (8192+512)", "banked8-8192-512")))


def residual_bank_stalls(folder=None, top: int = 8, files: dict | None = None) -> pd.DataFrame:
    """Why the table kernels' warps wait (Nsight Compute, one launch at 4096 x 28672, 4096+256, H200): per kernel,
    the average number of warps stalled for each reason per issued instruction (``smsp__average_warps_issue_stalled_
    <reason>_per_issue_active``; "selected" is the warp that issued). The ``top`` reasons of either kernel, largest
    first, a row each (the reason in the first column), a column a kernel; then, where the report has it, the
    launch's executed warp instructions in millions. ``files``: other reports, a column name to a glob
    (:data:`NCU_SMALL_STALLS`, :data:`NCU_LARGE_STALLS`: a small and a large layer's kernels with ncu's cache
    flush and without)."""
    cols, executed = {}, {}
    for what, pattern in (files or NCU_RESIDUAL_STALLS).items():
        for f in sorted(_root(folder).glob(pattern)):
            text = f.read_text()
            found = re.findall(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio\s+inst\s+([\d.]+)", text)
            cols[what] = {reason.replace("_", " "): float(v) for reason, v in found}
            n = re.search(r"^\s*Executed Instructions\s+inst\s+([\d,]+)", text, re.M)
            if n:
                executed[what] = int(n.group(1).replace(",", "")) / 1e6
    if not cols:
        return pd.DataFrame()
    d = pd.DataFrame(cols)
    keep = d.max(axis=1).sort_values(ascending=False).index[:top]
    out = d.loc[keep]
    if executed:
        out = pd.concat([out, pd.DataFrame(executed, index=[EXECUTED])])
    out.index.name = STALL_REASON
    return out.round(2).reset_index()  # the reasons a column: styled tables hide the index


def fig_residual_timeline(folder=None, shape=(4096, 28672), codebooks=(4096, 256), timelines=None) -> Figure:
    """One launch of the tensor-core table kernel, a bar a block (sorted by start): the prologue (codebooks
    and x staged), the table steps, and the finish, coloured by what the block summed. One panel a probe's
    timeline (``timelines``, by default :func:`residual_timelines`), all on one time axis."""
    tl = residual_timelines(folder, shape, codebooks) if timelines is None else timelines
    colours = {0: "#bbbbbb", 1: "#f0a030", 2: "#d62728", 3: "#2ca02c"}
    with _style():
        fig = Figure(figsize=(9, 1.5 + 1.45 * max(1, len(tl))), layout="constrained")
        axes = np.atleast_1d(fig.subplots(max(1, len(tl)), 1, sharex=True))
        for ax, (label, b) in zip(axes, tl):
            b = b.sort_values(["start", "block_x", "block_y"]).reset_index(drop=True)
            y = np.arange(len(b))
            ax.barh(y, b["prologue"] - b["start"], left=b["start"], height=1.0, color="#8c8c8c", linewidth=0)
            ax.barh(y, b["steps"] - b["prologue"], left=b["prologue"], height=1.0, color="#4c72b0", linewidth=0)
            ax.barh(y, b["finish"] - b["steps"], left=b["steps"], height=1.0, color=[colours[int(v)] for v in b["sums"]], linewidth=0)
            ax.set_ylim(-0.5, len(b) - 0.5)
            ax.set_yticks([])
            ax.set_ylabel(f"{len(b)} blocks", fontsize=8)
            ax.set_title(label, fontsize=9, loc="left")
        axes[-1].set_xlabel("us after the first block's start (one launch, instrumented)")
        handles = [mpl.patches.Patch(color=c, label=t) for c, t in
                   (("#8c8c8c", "prologue"), ("#4c72b0", "table steps"), (colours[0], "finish: partial written"),
                    (colours[1], "finish: summed a run of K-slices"), (colours[2], "finish: summed the partials into y"))]
        if any((b["sums"] == 3).any() for _, b in tl):
            handles.append(mpl.patches.Patch(color=colours[3], label="finish (spread): waited, summed a share of the rows"))
        fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    return fig


VQ_TARGETS = {"faster than fp16": 114, "geometric mean": 3.0, "min at in x out >= 4096 x 28672": 4.0, "2-bit additive at >= 4096 x 14336": 5.0,
              "4-bit additive at >= 4096 x 14336": 3.0}


def vq_floors(df: pd.DataFrame) -> pd.DataFrame:
    """Each vector-codebook configuration with a recorded streaming floor: the floor (a kernel that only reads
    the configuration's code bytes, ``trapetum vq --parts floors``), fp16 of the floor's own run, and our
    numba kernel of the newest run that timed it. "fp16 / floor" is the speedup no kernel that reads those
    bytes from DRAM can pass; "ours / floor" how far ours is from it. Empty where no run recorded floors."""
    fl = df[(df["grid"] == FLOOR_GRID) & df["time_ms"].notna()].copy()
    if fl.empty:
        return pd.DataFrame()
    res = _residual(df)
    add = df[(df["grid"] == "additive") & (df["kernel"] == "additive") & df["time_ms"].notna()]
    rows = []
    for r in fl.to_dict("records"):
        if r["floor_of"] == "residual":
            m = res[(res["gpu"] == r["gpu"]) & (res["in_features"] == r["in_features"]) & (res["out_features"] == r["out_features"])
                    & (res["main_centroids"] == r["main_centroids"]) & (res["residual_centroids"] == r["residual_centroids"])]
        else:
            m = add[(add["gpu"] == r["gpu"]) & (add["in_features"] == r["in_features"]) & (add["out_features"] == r["out_features"])
                    & (add["scheme"] == r["scheme"])]
        ours = m.iloc[0] if len(m) else None
        rows.append({"GPU": gpu_label(r["gpu"]), "part": r["floor_of"], "scheme": r["scheme"],
                     "in_features": int(r["in_features"]), "out_features": int(r["out_features"]),
                     "code MB": r["code_bytes"] / 1e6,
                     "floor (us)": r["time_ms"] * 1e3, "fp16 / floor": r["speedup"],
                     "ours (us)": ours["time_ms"] * 1e3 if ours is not None else np.nan,
                     "ours: speedup": ours["speedup"] if ours is not None else np.nan,
                     "ours / floor": ours["time_ms"] / r["time_ms"] if ours is not None else np.nan,
                     "floor run": r["git_commit"], "ours run": ours["git_commit"] if ours is not None else None})
    return pd.DataFrame(rows)


def vq_floor_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Issue 3's five speed targets beside what a kernel that only reads the code bytes would reach (the
    ceiling) and what ours reaches, per GPU, as display strings (:func:`_target_value`). Empty where no
    run recorded floors."""
    f = vq_floors(df)
    if f.empty:
        return f
    rows = []
    for gpu, g in f.groupby("GPU"):
        r = g[g["part"] == "residual"]
        big = r[r["in_features"] * r["out_features"] >= LARGE_RESIDUAL]
        large = g[(g["part"] == "additive") & (g["in_features"] * g["out_features"] >= 4096 * 14336)]
        a, a4 = large[large["scheme"] == "2-bit additive (M=2)"], large[large["scheme"] == "4-bit additive (M=4)"]
        for what, target, n, ceiling, ours in (
                ("residual grid: configs faster than fp16", VQ_TARGETS["faster than fp16"], len(r), (r["fp16 / floor"] > 1).sum(),
                 (r["ours: speedup"] > 1).sum()),
                ("residual grid: geometric-mean speedup", VQ_TARGETS["geometric mean"], len(r), _geomean(r["fp16 / floor"]),
                 _geomean(r["ours: speedup"].dropna())),
                ("residual grid: min speedup at in x out >= 4096 x 28672", VQ_TARGETS["min at in x out >= 4096 x 28672"], len(r),
                 big["fp16 / floor"].min(), big["ours: speedup"].min()),
                ("2-bit additive: min speedup at in x out >= 4096 x 14336", VQ_TARGETS["2-bit additive at >= 4096 x 14336"], len(a),
                 a["fp16 / floor"].min(), a["ours: speedup"].min()),
                ("4-bit additive: min speedup at in x out >= 4096 x 14336", VQ_TARGETS["4-bit additive at >= 4096 x 14336"], len(a4),
                 a4["fp16 / floor"].min(), a4["ours: speedup"].min())):
            unit = "n" if what.endswith("faster than fp16") else "x"
            rows.append({"GPU": gpu, "measure": what, "target (issue 3)": _target_value(target, unit), "configs": n,
                         "ceiling: a kernel that only reads the codes": _target_value(ceiling, unit), "ours": _target_value(ours, unit),
                         "met": _target_met(ours, target)})
    return pd.DataFrame(rows)


def fig_vq_floor(df: pd.DataFrame) -> Figure:
    """Ours against the ceiling, one point a configuration: x the speedup of a kernel that only reads the code
    bytes, y our kernel's; the diagonal is the ceiling itself. One panel a GPU with recorded floors."""
    f = vq_floors(df)
    if f.empty or f["ours: speedup"].isna().all():
        raise ValueError("no recorded run has both vector-codebook floors and timings (`trapetum vq --parts floors`)")
    f = f.dropna(subset=["ours: speedup"])
    gpus = sorted(f["GPU"].unique())
    with _style():
        fig = Figure(figsize=(max(6.0, 5.2 * len(gpus)), 4.6), layout="constrained")
        axes = np.atleast_1d(fig.subplots(1, len(gpus), sharey=True, squeeze=False)[0])
        hi = float(max(f["fp16 / floor"].max(), f["ours: speedup"].max())) * 1.08
        for ax, gpu in zip(axes, gpus):
            g = f[f["GPU"] == gpu]
            for i, (scheme, s) in enumerate(sorted(g.groupby("scheme"), key=lambda t: t[0])):
                ax.scatter(s["fp16 / floor"], s["ours: speedup"], s=18, color=f"C{i}", marker=_MARKERS[i % len(_MARKERS)], label=scheme)
            ax.plot([0, hi], [0, hi], color="0.4", lw=1, ls="--", label="the ceiling (ours = a kernel that only reads)")
            ax.axhline(1, color="0.3", ls=":", lw=1)
            ax.set_xlim(0, hi)
            ax.set_ylim(0, hi)
            ax.set_title(gpu)
            ax.set_xlabel("fp16 / streaming floor of the code bytes")
        axes[0].set_ylabel("ours: speedup over torch fp16")
        _shared_legend(fig, axes, ncols=3)
    return fig


def fig_decode_pareto(df: pd.DataFrame) -> Figure:
    """Bits per weight against graphed tok/s (left) and peak VRAM (right): one line per GPU and model,
    one point per scheme family (its fastest variant of LM head and embedding; the table has them all),
    each family named once a panel."""
    d = best_graphed(df).copy()
    bits = d["bits_per_weight"] if "bits_per_weight" in d else pd.Series(np.nan, index=d.index)
    d["bits"] = bits.fillna(d["bits_per_weight_codes"]).astype(float)
    d["family"] = d["scheme"].str.split(",").str[0]  # "4-bit K=16, LM head 4-bit K=16" -> "4-bit K=16"
    d = d.sort_values("tok_s").drop_duplicates(["gpu_label", "model", "family"], keep="last")
    lines = sorted(d[["gpu_label", "model"]].drop_duplicates().itertuples(index=False))
    gpus = sorted(d["gpu_label"].unique())
    models = sorted(d["model"].unique())
    with _style():
        fig = Figure(figsize=(11, 4.2), layout="constrained")
        axes = fig.subplots(1, 2, sharex=True)
        for gpu, model in lines:
            s = d[(d["gpu_label"] == gpu) & (d["model"] == model)].sort_values("bits")
            for ax, col in zip(axes, ("tok_s", "vram_gb")):
                ax.plot(s["bits"], s[col], marker=_MARKERS[models.index(model) % len(_MARKERS)],
                        color=_GPU_COLORS[gpus.index(gpu) % len(_GPU_COLORS)], label=f"{gpu}, {model}")
        for ax, col in zip(axes, ("tok_s", "vram_gb")):
            for fam, f in d.dropna(subset=[col]).groupby("family"):
                top = f.loc[f[col].idxmax()]
                ax.annotate(fam, (top["bits"], top[col]), xytext=(4, 4), textcoords="offset points", fontsize=8)
        for ax, label, title in zip(axes, ("decode tok/s (fastest graphed path)", "peak VRAM (GB)"), ("Speed, batch 1", "Memory")):
            ax.set_xscale("log", base=2)
            ax.set_xticks([2, 3, 4, 8, 16], ["2", "3", "4", "8", "16"])
            ax.set_xlim(1.7, 20)
            ax.set_xlabel("bits per weight (codes, codebooks and scales)")
            ax.set_ylabel(label)
            ax.set_title(title)
        axes[1].set_yscale("log")
        axes[1].yaxis.set_major_formatter(mpl.ticker.ScalarFormatter())
        axes[1].yaxis.set_minor_formatter(mpl.ticker.NullFormatter())
        axes[1].set_yticks([5, 10, 20, 40, 80])
        _shared_legend(fig, axes, ncols=3)
        fig.suptitle("Random weights, real Llama-2 architectures", fontsize=10)
    return fig


# --------------------------------------------------------------------------- the served input rotation

ROTATION_PROBES = "_runs/rotation-probe-*.json"  # trapetum.hadamard's launch alone and rotated layers, per version
ROTATION_DECODE_RUNS = "_runs/rotation-decode-*.json"  # decode runs of the rotation's earlier versions (code in git history)


def rotation_probe(folder=None) -> pd.DataFrame:
    """The rotation launch alone (:mod:`trapetum.hadamard`, each probe file a version of its kernel, oldest
    first): one row a probe, input size and batch: its factors (n = m p), the median launch in a CUDA graph
    and the max relative error against the same transform in fp64, checked first on loud inputs with the
    output poisoned."""
    rows = []
    for name, prov, recs in _probe_files(folder, ROTATION_PROBES):
        m = re.search(r"-(v\d+)-", name)
        for r in recs:
            if r.get("kind") == "rotation":
                rows.append({"GPU": gpu_label(prov.get("gpu", "")), "commit": str(prov.get("git_commit"))[:7],
                             "kernel": r.get("version") or (m.group(1) if m else "?"), "inputs": int(r["n_in"]),
                             "pre-operation": r.get("pre") or "-", "m x p": f"{r['m']} x {r['p']}", "batch": int(r["batch"]),
                             "launch (us)": 1e3 * float(r["time_ms"]), "max rel. error": float(r["max_rel_err"]),
                             "all written": bool(r["finite"])})
    return pd.DataFrame(rows)


def rotation_layers(folder=None) -> pd.DataFrame:
    """What the rotation adds to one layer (the newest probe of each GPU): torch fp16, and the 4-bit and
    2-bit codebook layers without and with their inputs rotated, each a QLinear call timed over CUDA-graph
    replays in one process (random weights, real shapes; every GEMV on its planner's heuristic plan), and
    the rotated layer's max relative error against fp64 (the codes applied to the rotated input)."""
    newest = {}
    for _, prov, recs in _probe_files(folder, ROTATION_PROBES):
        if any(r.get("kind") == "layer" for r in recs):  # the launch-only probes time no layer
            newest[gpu_label(prov.get("gpu", ""))] = (prov, recs)
    rows = []
    for gpu, (prov, recs) in newest.items():
        for r in recs:
            if r.get("kind") != "layer":
                continue
            row = {"GPU": gpu, "layer": f"{r['model']} {r['layer']}", "in x out": shape_label((int(r["n_in"]), int(r["n_out"]))),
                   "fp16 (us)": 1e3 * r["fp16_ms"]}
            for k, name in (("K16", "4-bit K=16"), ("A2", "2-bit additive")):
                row[f"{name} (us)"] = 1e3 * r[f"{k}_ms"]
                row[f"{name}, rotated (us)"] = 1e3 * r[f"{k}_rot_ms"]
                row[f"{name}: rotated / plain"] = r[f"{k}_rot_ms"] / r[f"{k}_ms"]
            row["max rel. error (rotated)"] = max(r["K16_rot_max_rel_err"], r["A2_rot_max_rel_err"])
            rows.append(row)
    return pd.DataFrame(rows)


# decode_bench's ``rotate`` values (and the o_proj probe's, data/_runs) -> what each rotates at run time
ROTATION_MODES = {"inputs": "every projection's inputs at run time", "stream+o": "residual stream offline; o_proj, down_proj at run time",
                  "stream": "residual stream offline; down_proj at run time"}


def _rotation_mode(v) -> str | None:
    """A decode record's ``rotate`` as a :data:`ROTATION_MODES` key, None where it is not rotated (False, NaN)."""
    if v is True or v == 1.0:
        return "inputs"
    return v if isinstance(v, str) and v in ROTATION_MODES else None


def _unrotated(scheme: str) -> str:
    """The scheme name of a rotated decode row's plain twin (its name up to the rotation's suffix)."""
    from .decode import ROTATED, STREAM_ROTATED  # torch and transformers: only where a rotation table is drawn

    return scheme.split(ROTATED)[0].split(STREAM_ROTATED)[0]


def _rotation_launches(profile) -> tuple[float, float]:
    """A profiled token's rotation launches: (how many, their time in us), NaN without a profile."""
    if not isinstance(profile, str):
        return np.nan, np.nan
    rows = [(c, us) for name, c, us in json.loads(profile)["rows"] if name.startswith("trapetum::hadamard::")]
    return float(sum(c for c, _ in rows)), float(sum(us for _, us in rows))


def rotation_decode(df: pd.DataFrame, folder=None) -> pd.DataFrame:
    """Each rotated decode row beside the same run's unrotated row of that scheme and path (decode_bench
    ``--rotate both``; every recorded run, the ones a newer run replaced in ``df`` (:func:`load_decode`) too, so
    each kernel version's run keeps its row, and the earlier versions' runs in :data:`ROTATION_DECODE_RUNS`):
    tok/s both ways, their ratio, and the rotated token's time in its rotation launches (its profile). Random
    weights, real architectures."""
    every = _decode_runs(folder)  # whole files: a newer plain row must not unpair a rotated one
    frames = [df[~df["file"].isin(set(every.get("file", ())))] if "file" in df else df, every]
    for path in sorted(_root(folder).glob(ROTATION_DECODE_RUNS)):
        prov, d = results.read(path)
        frames.append(d.assign(file=path.name, gpu_label=gpu_label(prov.get("gpu", "")), git_commit=prov.get("git_commit"),
                               date=prov.get("date")))
    rows = []
    for d in frames:
        if "rotate" not in d:
            continue
        rot = d[d["rotate"].map(_rotation_mode).notna() & d["tok_s"].notna()]
        for _, r in rot.iterrows():
            plain = d[(d["file"] == r["file"]) & (d["scheme"] == _unrotated(r["scheme"])) & (d["path"] == r["path"])
                      & (d["fused"] == r["fused"]) & d["tok_s"].notna()]
            if plain.empty:
                continue
            p = plain.iloc[-1]
            launches, us = _rotation_launches(r.get("profile"))
            rows.append({"_date": str(r.get("date")), "GPU": r["gpu_label"], "Model (random weights)": r["model"], "Scheme": p["scheme"],
                         "Rotation": ROTATION_MODES[_rotation_mode(r["rotate"])], "Path": r["path"] + (FUSED_SUFFIX if r["fused"] else ""),
                         "run (commit)": str(r.get("git_commit"))[:7], "tok/s": float(p["tok_s"]), "tok/s, rotated": float(r["tok_s"]),
                         "rotated / plain": float(r["tok_s"] / p["tok_s"]), "rotation launches a token": launches,
                         "rotation launches (us a token)": us})
    cols = ["GPU", "Model (random weights)", "Scheme", "Rotation", "Path", "run (commit)", "tok/s", "tok/s, rotated", "rotated / plain",
            "rotation launches a token", "rotation launches (us a token)"]
    if not rows:
        return pd.DataFrame(columns=cols)
    order = {v: i for i, v in enumerate(ROTATION_MODES.values())}
    t = pd.DataFrame(rows).assign(_mode=lambda x: x["Rotation"].map(order))
    t = t.sort_values(["GPU", "Model (random weights)", "Scheme", "_mode", "_date"])  # each mode, each kernel version in turn
    return t[cols].reset_index(drop=True)


def served_rotation_accuracy(folder=None, model: str = "smollm2-135m") -> pd.DataFrame:
    """:func:`trapetum.pipelines.served_rotation_runs` of ``<folder>/accuracy``: the served 2-bit additive model's
    perplexity under each rotation mode (the decode runs' keys; "none" unrotated), one row a run."""
    from .pipelines import served_rotation_runs  # torch: only where this table is drawn

    return served_rotation_runs(_root(folder) / "accuracy", model)


def rotation_tradeoff(t: pd.DataFrame, acc: pd.DataFrame, model: str = "llama-2-7b") -> pd.DataFrame:
    """Each way of serving the rotation, speed beside accuracy: the newest :func:`rotation_decode` row of each mode
    and scheme at ``model`` (random weights: tok/s kept against the same run's unrotated row, launches a token) and
    :func:`served_rotation_accuracy`'s runs of that mode (SmolLM2-135M, real weights: perplexity, % over the reference).
    The two halves are different models: what one row says is how a mode trades one for the other."""
    cols = ["Rotation", "run-time rotations a 7B token", "7B 2-bit additive: tok/s kept", "7B 4-bit K=16: tok/s kept",
            "speed runs (commit)", "SmolLM2 2-bit additive, served: PPL", "vs reference"]
    if acc.empty and t.empty:
        return pd.DataFrame(columns=cols)
    newest = t[t["Model (random weights)"] == model].groupby(["Scheme", "Rotation"], sort=False).tail(1)
    rows = []
    for mode, label in [("none", "none")] + list(ROTATION_MODES.items())[::-1]:
        d = newest[newest["Rotation"] == label]
        kept = {k: d[d["Scheme"].str.startswith(k)]["rotated / plain"] for k in ("2-bit additive", "4-bit K=16")}
        a = acc[acc["mode"] == mode]
        launches = d["rotation launches a token"].dropna()
        rows.append({"Rotation": label,
                     "run-time rotations a 7B token": 0.0 if mode == "none" else (float(launches.iloc[-1]) if len(launches) else np.nan),
                     "7B 2-bit additive: tok/s kept": 1.0 if mode == "none" else (float(kept["2-bit additive"].iloc[-1]) if len(kept["2-bit additive"]) else np.nan),
                     "7B 4-bit K=16: tok/s kept": 1.0 if mode == "none" else (float(kept["4-bit K=16"].iloc[-1]) if len(kept["4-bit K=16"]) else np.nan),
                     "speed runs (commit)": ", ".join(dict.fromkeys(d["run (commit)"])) or "–",
                     "SmolLM2 2-bit additive, served: PPL": ", ".join(f"{v:.2f}" for v in a["ppl"]) or "–",
                     "vs reference": ", ".join(f"{v:+.0f} %" for v in a["vs reference (%)"]) or "–"})
    return pd.DataFrame(rows, columns=cols)


def rotation_summary(t: pd.DataFrame) -> str:
    """One line on :func:`rotation_decode`'s newest rows: the share of tok/s the rotation keeps, and the share of the
    rotated token its launches take (from its profile). Empty without a rotated row."""
    if t.empty:
        return ""
    newest = t.groupby(["GPU", "Model (random weights)", "Scheme", "Rotation"], sort=False).tail(1)
    parts = []
    for _, r in newest.iterrows():
        us = r["rotation launches (us a token)"]
        share = "" if pd.isna(us) else f", its rotation launches {us / (1e6 / r['tok/s, rotated']):.0%} of the rotated token"
        parts.append(f"{r['Model (random weights)']} {r['Scheme']} on the {r['GPU']} ({r['run (commit)']}), {r['Rotation']}, keeps "
                     f"{r['rotated / plain']:.0%} of its tok/s{share}")
    return "As served now: " + "; ".join(parts) + "."
