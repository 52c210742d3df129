"""Command line: ``trapetum gemv`` measures the GEMV chapter on this machine's GPU."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time


def _gemv(args) -> int:
    import torch

    from . import bench, results
    from .gemv import NoGPUError

    if not torch.cuda.is_available():
        raise NoGPUError("`trapetum gemv` measures on a CUDA GPU and none is visible; the book renders recorded data without one")
    t0 = time.time()
    shapes = [(256, 96), (1024, 1000), (4096, 4096), (3072, 768), (2048, 14336)]
    checks = bench.correctness_sweep(shapes, progress=not args.quiet)
    print(f"correctness: {len(checks)} checks passed in {time.time() - t0:.0f} s", flush=True)
    copy = bench.copy_bandwidth()
    print("copy bandwidth: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in copy.items()), flush=True)
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
    for c in checks:
        c["grid"] = "correctness"
    prov = results.provenance(command=args.command or " ".join(sys.argv), **copy, **extra, seconds=round(time.time() - t0, 1))
    path = results.save("gemv", recs + checks, prov, folder=args.out)
    print(f"wrote {path}")
    return 0


DECODE_COMMANDS = ("generate", "check", "bench")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="trapetum", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gemv", help="correctness sweep, then the GEMV timings; writes <out>/<gpu>/gemv.json")
    g.add_argument("--out", default=None, help="results folder (default: the repository's data/)")
    g.add_argument("--command", default=None, help="the command to record in the provenance")
    g.add_argument("--quiet", action="store_true")
    g.add_argument("--arch", default=None, help="nvcc -arch for the CUDA C++ counterpart (default: this GPU's, e.g. sm_90)")
    g.add_argument("--cuda-cpp", dest="cuda_cpp", action="store_true", default=True,
                   help="also build and time the CUDA C++ counterparts in kernels/ (the default)")
    g.add_argument("--no-cuda-cpp", dest="cuda_cpp", action="store_false", help="skip building and running kernels/")
    g.set_defaults(func=_gemv)
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
