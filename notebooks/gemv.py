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
# # The bandwidth law
#
# This chapter times Trapetum's fused lookup-table GEMV kernels against torch fp16 on every GPU
# recorded under `data/`, and places them against the bandwidth law of the introduction,
# {eq}`eq-law`: the speedup over fp16 is the byte ratio of the formats times the ratio of the
# two kernels' bandwidth efficiencies.
#
# The speed benchmarks use random codes and random codebooks (random weights: speed does not
# depend on values). Correctness is checked separately, on fresh random inputs, against a
# float64 reference; every timing below is reported with the maximum relative error of its
# kernel. How the timings are taken is described in the introduction.

# %%
# %matplotlib inline

# %% tags=["parameters"]
# Papermill parameters. Without a GPU (the book build) these defaults render the recorded data.
arch = "sm_90"  # nvcc architecture for the CUDA C++ counterpart in kernels/ ("native" also works)
measure = "auto"  # "auto": measure when a CUDA GPU is visible, else render data/; True or False force it
in_features = [4096, 14336, 8192, 16384]  # the large shapes of the bandwidth grid, paired
out_features = [14336, 4096, 28672, 53248]  # with in_features: (4096 x 14336), (14336 x 4096), ...
iterations = 30  # timed CUDA-graph replays per measurement (the median is reported)
out = None  # results folder (None: the data/ folder of the repository)
run_cuda_cpp = True  # also build and time the CUDA C++ kernels of kernels/

# %%
from pathlib import Path

from IPython.display import Markdown, display

from trapetum import report, results

folder = Path(out) if out is not None else results.DATA_DIR

# %% [markdown]
# ## Measuring on your GPU
#
# Run under papermill on a machine with a CUDA GPU (`papermill notebooks/gemv.ipynb out.ipynb -p
# arch sm_86`), the next cell measures that GPU with `trapetum gemv` and writes
# `<folder>/<gpu>/gemv.json`, keeping any older run beside it; the rest of the chapter then shows
# your GPU beside the recorded ones. `-p measure True` insists on measuring (and stops with
# `trapetum.gemv.NoGPUError` where there is no GPU); `-p measure False`, or
# `TRAPETUM_RENDER_ONLY=1` as `make book` sets it, only renders the recorded files. On a machine
# without a GPU, as in the book build, nothing here touches a GPU.

# %%
if report.should_measure(measure):
    from trapetum import cli
    from trapetum.gemv import require_gpu

    require_gpu()  # raises trapetum.gemv.NoGPUError on a machine without a CUDA GPU
    params = dict(measure=True, arch=arch, in_features=in_features, out_features=out_features,
                  iterations=iterations, run_cuda_cpp=run_cuda_cpp)
    cli.main(report.measure_argv(out=out, arch=arch, in_features=in_features, out_features=out_features,
                                 iterations=iterations, run_cuda_cpp=run_cuda_cpp,
                                 command=report.papermill_command(**params)))

# %%
df = report.load_gemv(folder)

# %% [markdown]
# ## Where the numbers come from
#
# One row per GPU: the file its numbers come from and the GPU, driver, CUDA and library
# versions, git commit, date and command of the run that wrote it. The copy bandwidth, a
# device-to-device copy counting bytes read plus bytes written, was measured in the same run;
# it is the $B$ of the law.

# %%
report.styled(report.provenance_table(folder))

# %% [markdown]
# ## Every kernel at 4096 x 4096
#
# The seed's kernel table, remade at its shape (4096 inputs, 4096 outputs, batch 1) with each
# kernel timed beside torch fp16, which calls cuBLAS, in the same process. *vs cuBLAS* is the
# fp16 time divided by the kernel's time. *GB/s* counts the bytes a kernel must move (codes,
# codebooks, input and output) over its time, so a kernel that moves fewer bytes can be faster
# at a lower GB/s. The `lut32` and `naive` rows are kept as negative results: `lut32` is the
# product kernel with narrower code loads, `naive` skips the tiled layout. Look at how far each
# sits from `lut`, and at whether `lut` beats the baseline at this modest size at all. The
# `lut-fma`, `mma` and `dual` rows are the three batch-1 kernel families `lut` is tuned over, each
# held to its own family. `mma` and `dual` share one shared-memory table of fp16 pairs (a code
# byte looks up two weights) and run their multiply-adds on the tensor cores; they differ in the
# operand the looked-up weights become. In `mma` they are B and x sits on A's diagonal, so one
# mma takes 128 codes. In `dual` they are A, each lane holding its own row in each of two
# 32-row blocks, and x sits on B's diagonal, so one mma takes 256 codes, with half the mmas and
# none of the register moves that fed them. Where the tables later in this chapter name a plan's
# kernel, `dual` is the family the tuner picked.

# %%
report.styled(report.kernel_table(df))

# %% [markdown]
# ## Layer shapes
#
# The 4-bit kernel's speedup on the layer shapes the seed reports, beside the seed's numbers.
# The two are not the same experiment: the seed measured an RTX 4090 against `torch.mv`, we
# measure the GPUs named in the column headers against torch fp16 `x @ W.T`. Compare how the
# speedup changes from the small layer to the MLP layers, not the values across columns.

# %%
report.styled(report.layer_table(df))

# %% [markdown]
# ## numba and CUDA C++ side by side
#
# The CUDA C++ program in `kernels/` is built with `nvcc -O3 -arch=<arch>` and run in the same
# measuring run. Its `lut` kernel is the numba kernel's design written in C++ (its plans come from
# the same planner); its `mma` kernel is a different design: one shared-memory lookup serves two
# codes (a byte indexes a table of fp16 pairs) and the multiply-adds run on the tensor cores. Its
# `dual` kernel is the numba `dual` kernel written in C++ (the looked-up pairs as the mma's A
# operand, x on the diagonal of B); runs recorded before it existed leave its columns empty. The
# numba column is the tuner's pick at each shape, which is `dual` at the large ones. A ratio above 1
# means the numba kernel is slower. Each C++ row was checked against cuBLAS on the same codes before
# it was timed.

# %%
report.styled(report.numba_vs_cuda_cpp(df))

# %% [markdown]
# The C++ `dual` has also run on its own, the program alone, each plan checked against cuBLAS first.
# Its first version added the shared window's base address to every lookup, an integer multiply-add
# that numba's `dual` does not spend. The second takes its shared addresses from the dynamic array's
# symbol, so `ptxas` folds the base into the load (`LDS [R+UR]`), as in numba's kernel (NOTES.md,
# sessions 52 to 54). The numba column is the batch-1 pick of that GPU's recorded run, in another
# process, so read the last column as approximate. A ratio above 1 means the C++ kernel is slower.

# %%
report.styled(report.cpp_dual_runs(df))

# %% [markdown]
# ## Speedup against bandwidth
#
# The seed's claim is a law: the more bandwidth-limited the GPU, the larger the speedup. The
# table puts the 4-bit kernel's speedup on each GPU we measured beside the rows the seed
# reports. Our bandwidth is the copy bandwidth measured in the run, the seed's is the nominal
# bandwidth class its report names; the two are different quantities, so read the bandwidth
# axis as an ordering of GPUs rather than a scale on which our points and the seed's line up.

# %%
report.styled(report.bandwidth_law_table(df))

# %% [markdown]
# In the figure, filled markers are measured here, hollow markers are reported by the seed,
# and each colour is one codebook size. The short bar above each of our points is the ceiling
# of the law's first factor, the fp16 bytes over our bytes: the gap between a point and its bar
# is the second factor, how much less of the bandwidth our kernel reaches than cuBLAS. The left
# panel is at the seed's shape; the right panel is at the largest shape measured, where fixed
# per-launch costs matter least.

# %% mystnb={"figure": {"caption": "Speedup over fp16 against GPU memory bandwidth, at the seed's shape (left) and at the largest shape measured here (right). Filled: measured here; hollow: reported by the seed.", "name": "fig-gemv-law"}}
report.fig_bandwidth_law(df)

# %% [markdown]
# ## How close to the roofline
#
# The achieved bandwidth of each kernel at every batch-1 shape we timed, against the bytes
# it moves, with the GPU's copy bandwidth as a horizontal line. Small transfers do not reach
# the roofline: launch and synchronisation costs are paid whatever the size. The copy counts
# both reads and writes, so a kernel that mostly reads can sit above the line. The law's
# second factor is visible here as the vertical distance between torch fp16 and our kernels at
# a similar number of bytes.

# %% mystnb={"figure": {"caption": "Achieved bandwidth (bytes moved / time) of each kernel at each batch-1 shape, against the copy bandwidth measured in the same run.", "name": "fig-gemv-roofline"}}
report.fig_roofline(df)

# %% [markdown]
# ## What bounds the 4-bit kernel
#
# Two measurements from the same run place the 4-bit kernel against what its bytes allow. The
# *stream floor* is a kernel that only reads the same code bytes (16-byte loads, four in flight a
# thread, a grid of eight blocks an SM) and computes nothing: no kernel that must read those bytes
# once can beat it on that GPU. *Weight in L2* times our kernel on a single copy of its weight, so
# the codes stay in the L2 cache between launches (blank where the weight is too large for that).
# If our kernel were waiting on DRAM, the L2-resident time would be much shorter; where the two
# are close, the time goes to work inside the SMs (table lookups, multiply-adds, shared memory),
# not to memory. *fp16 / floor* is the speedup a kernel reaching the floor would have; the empty
# launch is the fixed cost of one graph node. Runs recorded before these measurements existed
# have no row here.

# %%
report.styled(report.floor_table(df))

# %% mystnb={"figure": {"caption": "Speedup over torch fp16 of the tuned 4-bit kernel by weight shape, beside the speedup of a kernel that only reads the same 4-bit bytes (the streaming floor).", "name": "fig-gemv-floor"}}
report.fig_floor(df)

# %% [markdown]
# ## Where the targets stand
#
# The speed targets this chapter set out to meet (on the H100, each a ratio against torch fp16 in
# the same run), with what we recorded on each GPU and, beside it, the ceiling: what a kernel that
# only reads the same 4-bit code bytes reaches (the streaming floor above; the codes are the same at
# every batch, so a batch row divides fp16 at that batch by the batch-1 floor). No floor times uint8
# codes, so their rows give the byte ratio instead, fp16's bytes over ours: a looser bound, as it
# assumes our bytes are read as efficiently as cuBLAS reads its own. "records" counts the shapes or
# batches a row takes its minimum over. Where the ceiling is itself below the goal, meeting it would
# take a kernel that reads the codes faster than the floor, which does nothing else, reads them.

# %%
display(Markdown(f"*{report.fp16_share_note(df)}*"))
report.styled(report.gemv_targets(df))

# %% [markdown]
# ## Speedup by shape
#
# The speedup over torch fp16 for every shape of the layer and bandwidth grids, one bar per
# codebook size, with the byte-ratio ceiling of each bar as a dashed mark. Bars below the dotted
# line are slower than fp16. Look at how the bars approach their ceilings as the weight grows.

# %% mystnb={"figure": {"caption": "Speedup over torch fp16 by weight shape (bars) and the byte-ratio ceiling, fp16 bytes over our bytes (dashed).", "name": "fig-gemv-shapes"}}
report.fig_speedup_by_shape(df)

# %% [markdown]
# ## Beyond batch one
#
# Decoding several sequences at once turns the GEMV into a small matrix product. For 4-bit
# codes the tuner picks among five fused kernels at each batch: the FMA table kernel, the
# diagonal tensor-core kernel (`mma`, batches up to 16, whose mma work grows by one per four
# batch rows) and `dual` (tuned up to batch 8, one mma per two batch rows); from batch 4 to 16 the `wide` tensor-core kernel, which feeds x to the mma as its
# A operand (16 batch rows an mma); and from batch 4 (alone above 16) the `tile` kernel, which feeds the looked-up
# weights to the mma as A the way a GEMM tiles them (each warp owns 32 rows over its K-slice;
# 8 batch rows an mma), so no warps' partial sums meet in shared memory. Each of the four lanes
# that read a row keeps its own copy of the row's 16-entry codebook in its own shared-memory bank,
# so a warp's 32 lookups are served in one pass instead of two. A block stages its slice of x
# with asynchronous copies (`cp.async`), every piece of a thread in flight at once: staged one
# load and one store at a time, it was the largest single stall of the batch-64 kernel under the
# profiler. Dequantize-then-cuBLAS, the
# large-batch path before the tensor-core kernels (and still the one for uint8 codes above 16), is
# timed beside them where it applies. A block
# of the wide kernel may walk several groups of 64 rows, staging its slice of x once; the tuner
# times both. The table names the kernel family and the plan the tuner picked at each batch; in
# the figure the shaded region is where torch fp16 is faster than the path a `QLinear` takes.

# %%
report.styled(report.batch_table(df))

# %% mystnb={"figure": {"caption": "Time per call against batch size for torch fp16, the fused 4-bit kernels (the tuned one at each batch) and dequantize-then-cuBLAS.", "name": "fig-gemv-batch"}}
report.fig_batch(df)

# %% [markdown]
# ### Two changes for large batches that lost
#
# At large batches the tile kernel stages its whole K-slice of x in shared memory, which forces a
# K-split at 4096 inputs, and the last block of each row group sums the K-slices' partials. Two
# changes aimed at those costs were built, checked against float64 and timed beside the committed
# kernel in one process, then reverted (their code is in the git history, at the probe's commit):
# x streamed through a ring of `cp.async` slots, one barrier a turn, so that small K-splits fit;
# and the K-slices added up by reductions in the L2, so that the last block only converts. The
# last column is the tried kernel at its fastest plan over the committed kernel at its recorded
# plan: above 1 is slower. Neither won at any batch. The barrier a turn holds the block's warps in
# lockstep, and scattered fp32 reductions cost far more than the round trips they remove;
# `NOTES.md` ("Session 39") has the counts and predictions.

# %%
report.styled(report.tile_trials(folder))

# %% [markdown]
# ### The lut kernel's K-split finish
#
# With a K-split, the last block of each row group sums that group's K-slice partials from L2. That
# block's threads hold RB x B rows each, where RB is the row-blocks a block and B the batch. Until
# d4029ca, warp 0 alone summed them, one row after another, so each row waited for its own L2 round
# trips. Now the block's warps share the rows, and up to 32 of a row's slices are in flight at once.
# Both versions ran at the same fixed plans in one process. These plans are not the tuned ones, so
# the times are not the kernel table's. The change matters where a block holds several row-blocks or
# batch rows and splits K. Most tuned batch-1 plans in the tables above have one row a lane or no
# K-split. The K=64 plans at the larger shapes have both 2 row-blocks a block and a K-split. Those
# tables were recorded before this change and have not been re-timed.

# %%
report.styled(report.lut_finish_probe(folder))
