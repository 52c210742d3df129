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
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # End to end
#
# Every decoder projection of a Llama-2 architecture is replaced by `trapetum.qlinear.QLinear`
# (4-bit, K = 16) and the model decodes greedily, batch 1, 512 tokens after a 32-token prompt,
# three ways (seed 004's integration paths): **naive** (a transformers-style loop with per-op
# dtype casts), **eager** (cast-free, static KV cache, one Python call per token) and **graphed**
# (the same step captured once in a CUDA graph: one replay is one token, Python does nothing per
# layer), plus a fourth, **compiled**: the step's forward goes through `torch.compile` first, with
# Trapetum's kernel registered as one opaque custom op, so the norms, rotary embedding and
# activations between the GEMVs are fused into fewer kernels; then it is graphed the same way.
# A fifth, **fused-step**, leaves transformers' layer code: `trapetum.step.FusedStep` runs each
# layer as five launches (the norms, SiLU x up and residual adds carried by the codebook GEMVs,
# rotary, the cache write and attention in one kernel of ours) and ends each token with one more
# (the argmax, the token's record and its embedding row for the next step), graphed.
# fp16 runs the same paths in the same run, and each path is compared with fp16 on that path and
# with fp16's fastest path.
#
# Rows marked **fused q/k/v, gate/up** stack each layer's query, key and value projections into
# one layer, and its gate and up projections into another (`trapetum.fuse`, as gpt-fast and vLLM
# do): the same weights row for row, half the GEMV launches, and larger shapes, where the
# previous chapters' kernels run closer to the bandwidth. They are compared with the fp16 model
# fused the same way in the same run. Additive layers share their codebooks within a layer, so a
# fused additive group is quantized jointly (one codebook set for q, k and v); an AQLM
# checkpoint's separate codebooks are left unfused.
#
# **Random weights, real architecture**: the models are built from the published Llama-2 configs
# with random weights on the GPU (speed does not depend on weight values). Tokens per second are
# timed with CUDA events; peak VRAM is `torch.cuda.max_memory_allocated`; J/token is the mean NVML
# power over the decode window times seconds per token. *Share of kernel bound* is a graphed
# path's tok/s over the tok/s implied by timing each projection's kernel (and the LM head) alone,
# at the tuner's fastest plan for it: what is left is attention, norms, rotary, sampling and the
# gaps between kernels. *Share of own kernel bound* is the same over the kernels the path itself
# launches: for the fused step, each projection's fused kernel with the norm, SiLU or residual add it
# fuses, at its own tuned plan: the lut kernel (or, for 4-bit codes, the dual tensor-core kernel) for the scalar formats, the table, streaming or chunk kernel for
# the 2-bit additive one, whichever the layer's batch-1 plan picked (other graphed paths launch the kernels the first bound times; a
# fused-step run that did not time its own kernels keeps the first share, a lower bound on this one).

# %%
# %matplotlib inline

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a CUDA GPU is visible, else render data/; True or False force it
arch = "llama-2-7b,llama-2-13b"  # comma-separated: llama-2-7b, llama-2-13b, llama-2-70b
gen = 512  # generated tokens
fuse = "both"  # fused q/k/v and gate/up projections: "off", "on" or "both" (every model twice)
out = None  # results folder (None: the data/ folder of the repository)

# %%
from IPython.display import Markdown, display

from trapetum import report, results

if report.should_measure(measure):
    from trapetum import decode

    decode.main(["bench", "--arch", arch, "--gen", str(gen), "--fuse", fuse] + (["--out", out] if out else []))
folder = out if out is not None else results.DATA_DIR
df = report.load_decode(folder)

# %% [markdown]
# ## Integration paths, models and GPUs
#
# *vs fp16* divides by the fp16 model's tok/s in the same run on the same graphed path (graphed,
# compiled or fused-step) with the same fusion; the naive and eager rows divide by fp16 graphed,
# the baseline a user would run. *vs fastest fp16* divides by the fastest fp16 graphed path of
# the same run: the honest ratio for the fused-step rows, because that path runs fp16
# projections unfused (cuBLAS takes no norm or residual add) and is slower for fp16 than the
# compiled path.
#
# *fused-step* is Trapetum's own decode step (`trapetum.step.FusedStep`), graphed: each layer is
# five launches, the RMSNorms, SiLU x up and residual adds carried by the codebook GEMVs and
# rotary, the cache write and attention in one kernel of ours (`trapetum.attention`). The
# *compiled* path runs transformers' code through torch.compile, which fuses the same elementwise
# work into ~8 inductor kernels a layer beside cuDNN's attention. From commit ebb2b5a the fused
# GEMVs' launch plans are tuned for the fused kernels themselves (`LutGemv.tune(B, pre, post)`), and every
# tuner re-times its fastest candidates, as one noisy timing had picked slower plans in some runs.
# Where fp16 does not fit on the GPU the row says so. Rows come from several runs (a later run
# of some paths replaces only those rows); *run* names each row's commit, and the provenance table
# at the end gives each file's command and versions. The 4-bit rows measured before the codes
# were held once (commit e73851b) report the higher VRAM of that older code. *VRAM vs fp16* is
# the peak over the fp16 model's peak on the same path in the same run, or, where that run
# measured fp16 on other paths only, over its fastest fp16 path's peak; a row's baselines always
# come from its own run. From commit 4753c29 each model's peak is its own: the previous model's
# cuBLAS workspaces are released first, and a prefill no longer holds a whole fp16 weight or
# keeps per-layer workspaces. Rows named "LM head 4-bit K=16" also store the LM head as a 4-bit
# codebook layer (its kernel is the projections'), and rows named "embedding 4-bit K=16" the
# token embedding (`QEmbedding`: it saves memory, not time); every other row keeps them in fp16.
# From commit 946656c the fused step's kernels are launched programmatically on sm_90 (see below);
# a run that timed it both ways (`bench --programmatic both`) also has a *fused-step (serial)* row,
# the same step with every launch waiting for the one before to finish.
# Rows named "residual 4096+256" store every projection as the residual (VPTQ-style) codebooks of
# the vector-codebook chapter (`ResidualQLinear`, its tuned split or table kernel a shape), measured
# on the compiled path; fused, a q/k/v or gate/up group shares one codebook set (quantized jointly),
# as an additive group does. The fused step runs them too, but around torch ops: their kernel takes
# no norm, SiLU or residual add.

# %%
report.styled(report.decode_table(df))

# %% [markdown]
# ## Speed and memory
#
# Graphed decode only. Look at how the 4-bit model's lead over fp16 compares with the kernel
# speedups of the previous chapter, and at which models fit under one GPU's memory.

# %% mystnb={"figure": {"caption": "Decode on the fastest of the graphed paths (graphed, compiled or fused-step), batch 1: tokens per second (top) and peak VRAM (bottom) of every scheme, one column a GPU, one colour a model. Random weights, real Llama-2 architectures.", "name": "fig-decode"}}
report.fig_decode(df)

# %% [markdown]
# ## Bits against speed and memory
#
# The Pareto view: each line is one model on one GPU, from its fp16 point to its codebook
# schemes. Up and to the left is better in the speed panel, down and to the left in the memory
# panel. A 70B model has no fp16 point on the H100: its fp16 weights alone do not fit in its
# memory (the table's out-of-memory row). The H200's larger memory holds them.

# %% mystnb={"figure": {"caption": "Bits per weight against decode tok/s on the fastest graphed path (left) and peak VRAM (right), batch 1: one point per scheme family, its fastest variant (LM head and embedding options; the table above has every row). Random weights, real Llama-2 architectures.", "name": "fig-decode-pareto"}}
report.fig_decode_pareto(df)

# %% [markdown]
# ## Where the targets stand
#
# The targets this chapter set out to meet (on the H100, batch 1, 512 tokens, fp16 timed on its
# fastest graphed path in the same run), each with the best graphed row of the table above and, beside
# it, what that row's own kernels allow: its *kernel bound*, the tokens per second if nothing but its
# projection and LM-head kernels ran, as a speedup over the same fastest fp16 (for the 70B row, as a
# share of the bandwidth bound). A goal above the kernel bound cannot be reached by a leaner decode
# step; the kernels themselves would have to get faster (the previous chapters). Peak memory has no
# such bound.
#
# The last rows ask how much of a token the graphed path loses outside its own kernels: the fastest
# row's tok/s over the bound of the kernels it launches (*share of own kernel bound* in the table
# above). For the fused step those are its fused projection kernels; what they leave is attention,
# rotary, sampling and the gaps between graph nodes. The table's *share of kernel bound* sets the
# same row against every projection at its fastest plan, which at some shapes is a tensor-core
# kernel: the difference between the two is what fusing costs in kernel time. For the scalar formats
# the lut kernel, and for 4-bit codes the dual tensor-core kernel, take the step's RMSNorm, SiLU and
# residual add with them (the norm and the add would otherwise be launches of their own); the rows
# recorded before the dual kernel took them (session 51) fused into the lut kernel alone. For the 2-bit additive format all three
# of its kernels take them, so what is left is the fused operations' own cost. The scalar formats'
# kernels and the additive streaming kernel have each block sum the squares of the whole input row
# before it builds its first table. The additive table and chunk kernels do not: each block sums only
# its own slice's squares, and those sums meet where the slices' partial sums do. The chunk kernel's
# global-finish plans (layers of more than 8 chunks, such as the 70B model's 8192 inputs) did this only
# from commit fb9ad0c; the vector-codebook chapter measures both ways.

# %%
repeats = report.decode_repeats(folder)
report.styled(report.decode_targets(df, repeats))

# %% [markdown]
# A row is the newest run of its configuration. Where the same sources were run more than once, *repeats*
# gives the ratio's spread over those runs (each against its own fp16): repeat runs land on other GPUs, or
# on the other GPU of a two-GPU host, and where they tuned their plans in the run the tuner's picks can
# differ too. A target inside a row's spread is marked as not met in every repeat. The repeated rows in full:

# %%
report.styled(repeats)

# %% [markdown]
# Where the rest of a fused-step token goes. Runs with `--profile` also record, in the same process
# and after the timed run, torch.profiler's kernel times over graph replays of one token. Below, for
# each such row: the token's wall time; the bound of its own kernels, each timed alone as above; the
# same kernels inside the step; attention; the other kernels (sampling, rotary); and the time between
# kernels. The wall time is the last four added together. So the gap to the bound is attention, the other
# kernels and the time between them, plus whatever the projections lose (or gain) by running in
# sequence. Timed alone, each projection's copies are rotated past the L2; in the step they follow
# one another.

# %%
report.styled(report.decode_step_profile(df))

# %% [markdown]
# ### Launches that start before the one before has finished
#
# In a CUDA graph each of the step's kernels normally starts only once the one before it has
# finished and flushed its writes, so every launch pays its blocks' start and its first round trip to
# memory on the token's critical path. On sm_90 a launch with CUDA's programmatic-stream-serialization
# attribute may start while its predecessor still runs. What a kernel loads before `griddepcontrol.wait`
# must not depend on that predecessor: the 2-bit GEMVs load their first codes and their codebook
# fragments (weights), attention loads the position and the cached K and V rows (written by earlier
# tokens), and each waits before it reads x or q/k/v. A kernel lets the next launch start
# (`griddepcontrol.launch_dependents`) only after its wait, so no launch ever runs beside one two
# places back, and only after its main loop. The first form released the next launch right after the
# wait; its blocks then took room on the SMs from the running grid and placed themselves unevenly,
# and the token got slower (the first row below). numba-cuda has no such launch option;
# `trapetum.gemv.programmatic` adds the attribute to numba's launch configuration. Each probe times
# a token (graph replays) and 512 generated tokens both ways in one process, and checks that the two
# give the same tokens and logits bit for bit.

# %%
report.styled(report.programmatic_probe(folder))

# %% [markdown]
# The 4-bit lut kernel was given the same wait and release: it loads its first codes and its
# codebooks, waits, then stages x. Launched that way, every 4-bit GEMV of the step made the token
# slower, and slower still when it released the next launch after its main loop than only at its exit
# (the probe's rows with the lut kernels launched programmatically). So the step launches the lut
# kernel serially; it keeps its release after the main loop, which lets the attention and greedy
# launches after it start early (the last row). The 2-bit chunk and streaming kernels stay
# programmatic. Why the lut kernel loses is not yet measured: its grids fill every SM with large
# blocks, and blocks placed beside a running grid may spread unevenly, as in the first form above.
# In the 4-bit probe the step's tokens agree with the eager path's on fewer positions than in the
# 2-bit ones; its two launch modes still give the same logits bit for bit, so the launch is not the
# cause, and where the first token differs (a near tie of a random-weight model's logits, or not)
# has not been looked at.

# %%
report.styled(report.programmatic_variants(folder))

# %% [markdown]
# ### Thread block clusters in the 2-bit step
#
# The chunk kernel meets a row-group's chunks either through the global finish (partial sums in a
# workspace, summed by the last block to finish) or inside one thread block cluster. Timed alone, as
# the vector-codebook chapter does, clusters of 10 and 16 chunks beat the global finish at several
# 13B and 70B layers. Chained in the decode step they did not. Each row below is one decode run in its
# own process (512 tokens, programmatic launch, torch fp16 in the same process), with the step bound
# of its own kernels timed alone. With the larger clusters the 13B step's kernels got faster and its
# tokens slower; at 70B the two runs are close. At 7B, whose clusters hold 8 chunks, the clusters win
# in the step too. Two later 13B runs also ran the step with every launch strictly serial (the rows
# without a step bound). Serially, the clusters of 10 beat the global finish, as they do alone; it is
# programmatic launch that gains the global plans much more than the clustered ones. So the larger
# clusters forfeit the overlap of a launch with the one before it. Each cluster's blocks must be placed
# together in one GPC, which may be what holds them back while the predecessor still occupies the SMs;
# that part is not measured. The tuner offers the fused step's calls clusters of at most 8 blocks.

# %%
report.styled(report.cluster_decode_ab(folder))

# %% [markdown]
# ### The 4-bit step's GEMVs on the tensor cores
#
# The `dual` kernel (the GEMV chapter's batch-1 tensor-core family) also takes the step's fused
# RMSNorm, SiLU and residual add. It stages x in fp16 as transformers' fp16 Llama rounds it, where
# the lut kernel keeps fp32. The probe below builds the 4-bit step twice in one process: once with
# every fused GEMV on the lut kernel, once with each on whichever of lut and dual its tuning found
# faster. It replays the two graphs alternately. These are probe rows on random weights, not
# recorded decode runs: torch fp16 was not timed in the same process, so the table sets the two
# steps against each other only. The two steps' greedy tokens part where one step's top two logits
# tie; the table gives that position, the gap in each step, and the largest logit difference
# before it.

# %%
report.styled(report.dual_step_probe(folder))

# %% [markdown]
# The dual kernel then launched serially, like the lut kernel: it staged x beside its codebooks and
# built its 64 KiB pair table after both. Its table depends on the weights alone, so it now builds the
# table first, waits for the launch before it, and only then stages x; the step launches it
# programmatically (`trapetum.gemv.PROGRAMMATIC_KERNELS`), and the table build overlaps the kernel
# before. The probe below builds the step both ways in one process (random weights, real
# architecture) and replays the two graphs alternately; the two gave the same tokens and the same
# logits bit for bit. Its second pair of rows asks whether o_proj, whose tuning keeps it on lut
# because dual's table build is too large a share of a 4096 x 4096 GEMV, should move to dual once that
# build is hidden: the token barely changes, so it stays on its tuned plan. Decode rows recorded since
# launch dual programmatically (each row's commit is in its provenance).

# %%
report.styled(report.dual_launch_probe(folder))

# %% [markdown]
# ## Serving a rotated model
#
# The accuracy chapter's best 2-bit rows fit the additive codebooks to each layer with its inputs rotated
# by a randomized Hadamard transform U (QuIP#'s incoherence processing; runs j and k there). Served, such a
# layer computes Q(W U^T) (U x): `quantize_model(..., rotate=True)` stores codes fitted that way, and
# `trapetum.hadamard` applies U to x in one launch before the unchanged GEMV. U = kron(B, H_p) diag(s) / sqrt(n),
# with p the largest power of two dividing n: the fast Walsh-Hadamard transform in shared memory, then a
# small dense B of odd order m = n / p (none at 4096 and 8192 inputs). Nothing is stored: B and the signs s
# come back from the seed. In the fused step the rotation launch also takes the GEMV's RMSNorm or SiLU x up
# prologue (it holds the whole row anyway), so a layer gains one launch per projection group and no torch op.
#
# The first table times the launch alone at the Llama-2 input sizes, one probe per version of its kernel,
# each checked first against the same transform in fp64 on loud inputs with its output poisoned. The second
# sets it inside one layer: a codebook GEMV with and without its inputs rotated, torch fp16 beside them, every
# GEMV on its planner's heuristic plan. The third is what it costs a decoded token: each rotated row beside
# the row of the same scheme without rotation from the same run (`bench --rotate all`).
#
# A second way to serve it is QuaRot's (Ashkboos et al. 2024): rotate the residual stream itself, offline.
# RMSNorm without its weight commutes with an orthogonal Q, so `quantize_model(..., rotate="stream")`
# (`trapetum.hadamard.rotate_residual`) folds each norm's weight into the layers that read it and stores the
# embedding as E Q^T, every reader of the stream (q/k/v, gate/up, the LM head) as W Q^T and every writer
# (o_proj, down_proj) as Q W, with each value head's outputs and o_proj's inputs rotated head by head. The
# model computes the same function, every layer's codes are fitted to rotated inputs, and only down_proj,
# whose input silu(gate) x up is not in the stream, rotates at run time: one launch a layer instead of four.
# A probe also rotated o_proj's inputs at run time (two a layer).

# %%
report.styled(report.rotation_probe(folder))

# %%
report.styled(report.rotation_layers(folder))

# %%
rotation = report.rotation_decode(df, folder)
display(Markdown(f"*{report.rotation_summary(rotation)}*"))
report.styled(rotation)

# %% [markdown]
# What each way buys and costs, side by side: the speed half from the runs above (Llama-2-7B architecture,
# random weights; the newest run of each mode, tok/s against the same run's unrotated row), the accuracy half
# from the served 2-bit additive SmolLM2-135M (real weights, `quantize_model(K="A2", calib=..., finetune=6,
# rotate=...)` with the accuracy chapter's run-d recipe, scored on the full WikiText-2 test text, ctx = stride
# = 2048; runs with one calibration hash in the file share their samples). The two halves are different models.

# %%
served = report.served_rotation_accuracy(folder)
report.styled(report.rotation_tradeoff(rotation, served))

# %% [markdown]
# Where n is a power of two (m = 1) the launch is one block a row, on one SM: its time is the latency of its
# passes over shared memory, not bytes. The first version computed each butterfly's index by dividing by the stage's stride, a runtime
# value, so every butterfly paid 64-bit divisions; the second uses shifts and masks and two stages a pass.
# The third issued every load of the row before the first use, with twice the threads, and gained nothing,
# so the loads' latency was not what was left. Nsight Compute then showed what was: the launch's one block
# issuing integer instructions, its index arithmetic in numba's default 64-bit integers (and its two scalars
# in fp64). The fourth computes every index in 32 bits, keeps B in shared memory and sums the RMSNorm's squares
# by warp shuffles; the first table times it against the third in one process. Up to the fourth, where m > 1
# (11008 inputs and above), each of up to 16 blocks a row transformed the whole row by H_p before its share of
# the dense B product. The fifth uses that the two factors commute, kron(B, H_p) = (B x I_p)(I_m x H_p) =
# (I_m x H_p)(B x I_p): block j forms only run j of (B x I_p) diag(s) x, m terms an output, and transforms only
# that run, so a row spreads over m blocks with no work repeated but the reading of the row (against the fourth
# in one process). The sixth applies the same to every size: Sylvester's H_p is kron(H_f, H_p'), so runs longer
# than 256 split further, B' = kron(B, H_f), and a 4096-point row takes 16 blocks where one took it whole (the
# table's last probe, against the fifth). Each block still reads, and for SiLU x up computes, the whole row.
#
# Rotating the stream offline keeps most of the speed but, on this model, only part of the accuracy: the
# table above says how much of each. Both offline forms differ from the per-layer rotation in two ways
# that the runs do not separate: o_proj and down_proj are rotated on their output side too (the accuracy
# chapter's run k, both sides, scored a little worse than run j, inputs only), and the fine-tuning trains the
# norms' weights in the rotated basis, where a per-channel scale no longer singles out a channel. Rotating
# o_proj's inputs at run time as well did not recover it. What is left of the launch's cost is mostly the launch
# itself; the next version would be the transform inside the GEMV's own staging of x (no launch).

# %% [markdown]
# ## A real model: each graphed path against eager
#
# Speed above is measured on random weights; correctness is checked on a real pretrained model,
# SmolLM2-135M-Instruct (the offline model: its linear layers ship as Q4_1, so its reference is
# that dequantized model), quantized to 4-bit K = 16 codebooks. `python -m trapetum.decode check`
# decodes 32 greedy tokens after the prompt on the eager path and on each graphed path of the same
# quantized model, and compares the tokens and the logits of every step. The graphed path
# replays the eager step's own kernels, so its logits should agree to the last bit. The compiled
# path (inductor's fused norms) and the fused step (norm and SiLU applied in fp32 as x is staged)
# round differently from eager, and those differences add up over the layers, so they are held to
# a looser tolerance (`trapetum.decode.CHECK_TOL`; the table applies it to each recorded run).

# %%
report.styled(report.decode_check_table(report.load_decode_checks(folder)))

# %% [markdown]
# ## Where the numbers come from

# %%
df[["gpu", "file", "driver", "cuda", "torch", "git_commit", "date", "command"]].drop_duplicates("file")
