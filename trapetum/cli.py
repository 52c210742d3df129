"""Command line: ``trapetum gemv`` and ``trapetum vq`` measure the GEMV chapters on this machine's GPU."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def _gemv(args) -> int:
    import torch

    from . import bench, results
    from .gemv import NoGPUError

    if not torch.cuda.is_available():
        raise NoGPUError("`trapetum gemv` measures on a CUDA GPU and none is visible; the book renders recorded data without one")
    t0 = time.time()
    resumed = _resumed(args.resume)
    if resumed:  # the first process's sweep and copy bandwidth; the timings are all this one's
        checks = [r for r in resumed["records"] if r.get("grid") == "correctness"]
        copy = resumed["copy"]
        if not checks or not copy:
            raise ValueError(f"--resume {args.resume}: it holds no correctness sweep and copy bandwidth (run --checks-only first)")
    else:
        shapes = [(256, 96), (1024, 1000), (4096, 4096), (3072, 768), (2048, 14336)]
        checks = bench.correctness_sweep(shapes, progress=not args.quiet)
        for c in checks:
            c["grid"] = "correctness"
        print(f"correctness: {len(checks)} checks passed in {time.time() - t0:.0f} s", flush=True)
        copy = bench.copy_bandwidth()
        print("copy bandwidth: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in copy.items()), flush=True)
    if args.checks_only:
        # The sweep alone, kept for a second process of the same commit (--resume): the sweep and the
        # timings together outgrow a 10-minute window on a fresh machine (every plan compiles).
        head = results.provenance(command=args.command or None)
        partial = results.write_partial("gemv", torch.cuda.get_device_name(), head, copy, checks, folder=args.out)
        print(f"wrote {partial}")
        return 0
    recs = bench.gemv_suite(progress=not args.quiet)
    extra = {}
    if args.cuda_cpp:
        # The CUDA C++ counterpart in the same run, so numba and C++ share the GPU's state.
        shapes = {(r["in_features"], r["out_features"]): r.get("grid") for r in recs if r["kernel"] == "lut" and r["batch"] == 1}
        try:
            for r in bench.run_cuda_cpp(args.arch):
                r["grid"] = shapes.get((r["in_features"], r["out_features"]), "cuda_cpp")
                recs.append(r)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            # Keep the numba results; the provenance says why the C++ rows are missing.
            print(f"CUDA C++ counterpart failed: {e}", file=sys.stderr)
            extra["cuda_cpp_error"] = str(e)[-2000:]
    for r in recs:
        r.update(copy)
    prov = _provenance(args, resumed, {**copy, **extra}, t0)
    path = results.save("gemv", recs + checks, prov, folder=args.out)
    print(f"wrote {path}")
    return 0


def _resumed(path) -> dict | None:
    """The first process's part of a run continued by a second (``--resume``): its provenance, copy
    bandwidth and records. One commit on one GPU: the first process's records are kept as they are,
    and everything the second measures is timed beside its own fp16 run."""
    if path is None:
        return None
    from . import results

    prov0, copy0, done = results.read_partial(path)
    now = results.provenance()
    for k in ("gpu", "git_commit", "source_id"):  # source_id: the sources as they ran (a device copy's git metadata can be stale)
        if prov0.get(k) != now.get(k):
            raise ValueError(f"--resume {path}: that run has {k} {prov0.get(k)!r}, this one {now.get(k)!r}; "
                             "a resumed run must continue one commit on one GPU")
    return {"prov": prov0, "copy": copy0, "records": done}


def _provenance(args, resumed: dict | None, extra: dict, t0: float, added: bool = True) -> dict:
    """A results file's provenance: this process's, or with ``resumed`` the first process's, saying so
    (``added``: whether this second process measured anything; not when the first had measured it all)."""
    from . import results

    if not resumed:
        return results.provenance(command=args.command or None, **extra, seconds=round(time.time() - t0, 1))
    p0 = resumed["prov"]
    if added:
        note = (f"measured by two processes of one commit: the first kept {len(resumed['records'])} records "
                f"(started {p0.get('date')}), the second ({results.invocation()}) the rest")
    else:
        note = (f"measured by one process (started {p0.get('date')}), which kept all {len(resumed['records'])} records; "
                f"a second ({results.invocation()}) found nothing left to measure")
    return {**p0, **extra, "resumed": note, "seconds_second_process": round(time.time() - t0, 1)}


VQ_PARTS = ("additive", "residual", "floors")


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return vals


def _codebooks(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple(tuple(int(v) for v in p.split("+")) for p in text.split(",") if p.strip())
    except ValueError:
        pairs = ()
    if not pairs or any(len(p) != 2 or min(p) <= 0 for p in pairs):
        raise argparse.ArgumentTypeError(f"codebooks are MAIN+RESIDUAL centroid counts, comma-separated (e.g. 4096+256,8192+512), got {text!r}")
    return pairs


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in VQ_PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"parts must be a comma-separated subset of {','.join(VQ_PARTS)}, got {text!r}")
    return parts


def _vq(args) -> int:
    import torch

    from .gemv import NoGPUError

    from . import residual

    for n in args.in_features or ():  # a clear error before anything is measured
        residual.check_in_features(n)
    for m, r in args.codebooks or ():
        residual.index_bits(m, r)
    if not torch.cuda.is_available():
        raise NoGPUError("`trapetum vq` measures on a CUDA GPU and none is visible; the book renders recorded data without one")

    from . import additive, bench, results

    t0 = time.time()
    resumed = _resumed(args.resume)
    done = resumed["records"] if resumed else []
    have = {(r.get("grid"), r.get("kernel")) for r in done}
    # Every timed record below is also checked on fresh inputs with its output poisoned; this sweep
    # adds batches, K-splits and the other plans the tuner may pick. Each plan and batch compiles.
    partial = None
    if args.out:
        # The provenance, then each record as it is made, so a run stopped part way still leaves
        # its measurements (results.adopt_partial turns the file into a results file).
        head = resumed["prov"] if resumed else results.provenance(command=args.command or None)
        partial = results.write_partial("vq_gemv", torch.cuda.get_device_name(), head, resumed["copy"] if resumed else {}, done,
                                        folder=args.out)

    def keep(r):
        if partial is not None:
            results.append_partial(partial, r)

    checks = [r for r in done if r.get("grid") == "correctness"]
    recs = [r for r in done if r.get("grid") != "correctness"]
    extra = {"parts": list(args.parts)}
    sweeps = (("additive", lambda: additive.correctness_sweep([(1024, 1000), (4096, 4096)], batches=(1, 3), progress=not args.quiet)),
              ("residual", lambda: residual.correctness_sweep([(1024, 1000)], batches=(1, 3), forced=False, progress=not args.quiet)))
    for name, sweep in sweeps:
        if name not in args.parts or ("correctness", name) in have:
            continue
        try:
            got = sweep()
        except Exception as e:  # noqa: BLE001 - recorded and shown; the timings still run, each with its own check
            extra[f"{name}_correctness_failures"] = str(e)[-3000:]
            print(f"CORRECTNESS FAILURES ({name}):\n{e}", flush=True)
            continue
        for c in got:
            c["grid"] = "correctness"
            keep(c)
        checks += got
        print(f"correctness ({name}): {len(got)} checks passed, {time.time() - t0:.0f} s so far", flush=True)
    if resumed and resumed["copy"]:
        copy = resumed["copy"]
    else:
        copy = bench.copy_bandwidth()
        print("copy bandwidth: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in copy.items()), flush=True)
        keep({"copy": copy})
    # The additive table resumes shape by shape, as the residual grid and the floors do; the C++ program
    # times all its shapes in one process and keeps nothing until it ends, so it runs once.
    if args.cuda_cpp and "additive" in args.parts and ("additive", "cuda_cpp_additive") not in have:
        try:
            for r in bench.run_cuda_cpp(args.arch, program="gemv_additive_2bit"):
                r["grid"] = "additive"
                recs.append(r)
                keep(r)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            print(f"CUDA C++ counterpart failed: {e}", file=sys.stderr)
            extra["cuda_cpp_error"] = str(e)[-2000:]
    grid = dict(bench.RESIDUAL_GRID)
    quick_grid = dict(grid, in_features=(1024, 4096), out_features=(1024, 14336), mains=(4096,), residuals=(256,))
    if args.quick:  # a corner of the grid, for a first look on a new GPU
        grid = dict(quick_grid)
    # A subset of the grid (e.g. the layers a kernel change touches): the book takes each configuration from the
    # newest run that measured it, so a partial run updates those rows only.
    for key, val in (("in_features", args.in_features), ("out_features", args.out_features), ("pairs", args.codebooks)):
        if val:
            grid[key] = val
    if "residual" not in args.parts:
        grid.update(in_features=())
    all_shapes = bench.ADDITIVE_SHAPES[:3] if args.quick else bench.ADDITIVE_SHAPES
    shapes = all_shapes if "additive" in args.parts else ()
    # The floors of every configuration of both parts, whichever parts are timed: a floors-only run is short.
    floors = dict(grid=quick_grid if args.quick else bench.RESIDUAL_GRID, additive_shapes=all_shapes) if "floors" in args.parts else None
    suite, suite_extra = bench.vq_suite(grid=grid, additive_shapes=shapes, aqlm=args.aqlm and "additive" in args.parts,
                                        progress=not args.quiet, on_record=keep,
                                        skip_residual={bench.residual_key(r) for r in done if r.get("grid") == "residual"},
                                        floors=floors, skip_floor={bench.floor_key(r) for r in done if r.get("grid") == "floor"},
                                        skip_additive={bench.additive_key(r) for r in done if r.get("grid") == "additive"})
    recs += suite
    extra.update(suite_extra)
    for r in recs:
        r.update(copy)
    prov = _provenance(args, resumed, {**copy, **extra}, t0, added=len(recs) + len(checks) > len(done))
    path = results.save("vq_gemv", recs + checks, prov, folder=args.out)
    print(f"wrote {path}")
    return 0


def _measure_options(g) -> None:
    g.add_argument("--out", default=None, help="results folder (default: the repository's data/)")
    g.add_argument("--command", default=None, help="the command to record in the provenance")
    g.add_argument("--quiet", action="store_true")
    g.add_argument("--arch", default=None, help="nvcc -arch for the CUDA C++ counterpart (default: this GPU's, e.g. sm_90)")
    g.add_argument("--cuda-cpp", dest="cuda_cpp", action="store_true", default=True,
                   help="also build and time the CUDA C++ counterparts in kernels/ (the default)")
    g.add_argument("--no-cuda-cpp", dest="cuda_cpp", action="store_false", help="skip building and running kernels/")


DECODE_COMMANDS = ("generate", "check", "bench")


def _plans(args) -> int:
    from . import tuning

    if args.clear:
        gone = tuning.clear_file()
        print(f"removed {gone}" if gone else f"no plan file to remove ({tuning.cache_path() or tuning.ENV + '=off'})")
        return 0
    try:
        path, current, rows = tuning.cached_plans()
    except ValueError as e:
        print(f"trapetum plans: {e}", file=sys.stderr)
        return 2
    if path is None:
        print(f"{tuning.ENV}=off: plans are tuned in each process and kept in it only")
        return 0
    print(f"{path}: {len(rows)} plans" + ("" if current or not rows else ", tuned by other sources (ignored: they will be tuned again)"))
    for r in rows:
        print(f"  {r['family']:9s} {r['key']}\n            {r['type']}({', '.join(f'{k}={v}' for k, v in r['fields'].items())})")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="trapetum", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gemv", help="correctness sweep, then the GEMV timings; writes <out>/<gpu>/gemv.json")
    _measure_options(g)
    g.add_argument("--checks-only", dest="checks_only", action="store_true",
                   help="the correctness sweep and copy bandwidth only, to <out>/<gpu>/gemv.partial.jsonl, for --resume")
    g.add_argument("--resume", type=Path, default=None, metavar="PARTIAL",
                   help="time on top of a --checks-only run's gemv.partial.jsonl (same commit and GPU)")
    g.set_defaults(func=_gemv)
    v = sub.add_parser("vq", help="vector codebooks: correctness, the 120-config residual grid, the additive table; "
                                  "writes <out>/<gpu>/vq_gemv.json")
    _measure_options(v)
    v.add_argument("--no-aqlm", dest="aqlm", action="store_false", default=True,
                   help="skip the `aqlm` package's kernel (by default timed where it builds)")
    v.add_argument("--quick", action="store_true", help="a corner of the grid only")
    v.add_argument("--parts", type=_parts, default=VQ_PARTS,
                   help="comma-separated parts to measure: additive (table, CUDA C++, aqlm), residual (the grid), "
                        "floors (a kernel that only reads each configuration's code bytes, fp16 beside it: a minute or two); "
                        "the book shows each part's newest run")
    v.add_argument("--in-features", dest="in_features", type=_ints, default=None, metavar="N,N",
                   help="residual grid: only these input sizes (default: the grid's 1024..16384)")
    v.add_argument("--out-features", dest="out_features", type=_ints, default=None, metavar="N,N",
                   help="residual grid: only these output sizes (default: the grid's 1024..53248)")
    v.add_argument("--codebooks", type=_codebooks, default=None, metavar="MAIN+RES,...",
                   help="residual grid: only these codebook pairs, e.g. 4096+512,8192+256 (default: all four)")
    v.add_argument("--resume", type=Path, default=None, metavar="PARTIAL",
                   help="continue a run that stopped part way, from its <out>/<gpu>/vq_gemv.partial.jsonl "
                        "(same commit and GPU): what it holds is kept, the rest is measured (the additive table and "
                        "the residual grid shape by shape; the CUDA C++ counterpart only if it did not run)")
    v.set_defaults(func=_vq)
    t = sub.add_parser("plans", help="the tuned launch plans kept across processes (trapetum.tuning): list or --clear")
    t.add_argument("--clear", action="store_true", help="remove the file: every shape is tuned again")
    t.set_defaults(func=_plans)
    # generate / check / bench live in trapetum.decode; `trapetum generate ...` hands them over.
    for name in DECODE_COMMANDS:
        sub.add_parser(name, add_help=False, help=f"see python -m trapetum.decode {name} --help")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DECODE_COMMANDS:
        from . import decode

        return decode.main(argv)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
