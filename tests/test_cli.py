"""The command line on a machine without a GPU: a clear error, not a crash deep in a kernel."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module", params=["gemv", "vq"])
def gemv_without_gpu(request, run_without_simulator, tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    return run_without_simulator(["-m", "trapetum.cli", request.param, "--quiet", "--out", str(out)]), out


def test_gemv_without_gpu_fails_with_NoGPUError(gemv_without_gpu):
    p, _ = gemv_without_gpu
    assert p.returncode != 0, p.stdout
    assert "NoGPUError" in p.stderr, p.stderr[-2000:]
    assert "GPU" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]


def test_gemv_without_gpu_writes_no_results(gemv_without_gpu):
    _, out = gemv_without_gpu
    assert not any(out.rglob("*")), sorted(map(str, out.rglob("*")))


def test_cli_requires_a_subcommand(run_without_simulator):
    p = run_without_simulator(["-m", "trapetum.cli"])
    assert p.returncode == 2 and "gemv" in p.stderr


def test_generate_is_handed_to_trapetum_decode(capsys):
    from trapetum import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
    assert "python -m trapetum.decode" in capsys.readouterr().out


@pytest.mark.parametrize("parts", ["bogus", "residual,bogus", ","])
def test_vq_parts_must_name_known_parts(parts, capsys):
    from trapetum import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["vq", "--parts", parts])
    assert e.value.code == 2
    assert "additive,residual" in capsys.readouterr().err


def test_vq_parts_parse():
    from trapetum import cli

    assert cli._parts("residual") == ("residual",)
    assert cli._parts(" additive , residual ") == ("additive", "residual")
