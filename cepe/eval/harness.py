"""lm-evaluation-harness model ``cepe`` (optional extra: ``pip install "cepe[harness]"``).

Importing this module registers the model with lm-evaluation-harness's registry
(``lm_eval.api.registry.register_model``); no fork. The package declares the model as an
``lm_eval.models`` entry point (``cepe = cepe.eval.harness:CepeLM``, pyproject.toml), the group through
which lm-eval's command line discovers installed models, so where the installed lm-eval reads that group
``lm_eval --model cepe ...`` works as it is. lm-eval 0.4.13's ``lm_eval`` script reads no plugins; there
the same command line with ``cepe`` registered is the console script ``cepe-lm-eval`` (:func:`cepe.eval.harness_cli.main`), or
``lm_eval.simple_evaluate(model="cepe", ...)`` after ``import cepe.eval.harness``::

    cepe-lm-eval --model cepe \\
        --model_args model=adapters/smollm2-135m-cepe,decoder_window=512 \\
        --include_path <dir from write_local_tasks> --tasks cepe_ppl,cepe_mc

Model arguments (``--model_args k=v,...``):

- ``model``: a CEPE adapter directory, ``default`` / a decoder directory (``method=truncated|full``
  only, unless ``cepe_init=true``), or ``tiny`` (random test model), as ``cepe eval --model``;
- ``method``: ``cepe`` (default), ``truncated`` (decoder window only) or ``full`` (everything in the
  decoder);
- ``decoder_window``: tokens the decoder reads (default 2048); text before them goes to the encoder in
  chunks of ``chunk_length`` tokens (default: the adapter's), aligned to the window;
- ``rolling_tokens``: tokens scored per decoder pass in ``loglikelihood_rolling`` (default half the window);
- ``max_gen_toks`` (default 256), ``dtype`` (``fp32|bf16|fp16``), ``autocast`` (``bf16|fp16``),
  ``device``, ``batch_size``, ``tokenizer``.

Requests:

- ``loglikelihood(context, continuation)``: tokens ``enc(context) + continuation tokens`` (trailing spaces
  of the context move to the continuation, as the harness's own models do; an empty context is the
  tokenizer's BOS, else EOS); the decoder reads the last ``max(decoder_window, len(continuation) + 1)``
  tokens, the encoder everything before;
- ``loglikelihood_rolling(text)``: the tokens are scored in blocks of ``rolling_tokens`` aligned to the
  end of the text; a block ending at token ``e`` is scored exactly as ``cepe eval lm`` scores the last
  ``rolling_tokens`` of a sequence of ``e`` tokens (:func:`cepe.eval.tasks.lm.window_request`); the first
  block is predicted from the BOS/EOS prefix token;
- ``generate_until(context, {until, max_gen_toks})``: greedy; the decoder reads the last
  ``decoder_window`` tokens of the context, the encoder the rest; the text is cut at the first stop string.

Shape legend: T tokens.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cepe.eval.methods import Request
from cepe.eval.tasks.lm import window_request
from cepe.fileio import write_text

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "cepe.eval.harness needs lm-evaluation-harness: pip install 'cepe[harness]' (or `pip install "
        "lm-eval==0.4.13`)"
    ) from err

HARNESS_METHODS = ("cepe", "truncated", "full")
HARNESS_EXTRA_ARGS = frozenset({"max_batch_size"})
"""Arguments lm-evaluation-harness adds to every model's (beyond ``batch_size`` and ``device``): accepted,
not used."""


def _bool(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


@register_model("cepe")
class CepeLM(LM):
    """A CEPE model (or its decoder alone) behind the lm-evaluation-harness ``LM`` interface."""

    def __init__(
        self,
        model: str = "default",
        method: str = "cepe",
        decoder_window: int = 2048,
        chunk_length: int | None = None,
        rolling_tokens: int | None = None,
        max_gen_toks: int = 256,
        dtype: str = "fp32",
        autocast: str | None = None,
        device: str | None = None,
        batch_size: int | str = 1,
        tokenizer: str | None = None,
        cepe_init: bool | str = False,
        setup: Any = None,
        **unused: Any,
    ):
        super().__init__()
        from cepe.dtypes import torch_dtype
        from cepe.eval.api import load_setup

        if method not in HARNESS_METHODS:
            raise ValueError(
                f"cepe harness model: method={method!r} is not supported; choose from {HARNESS_METHODS} "
                "(StreamingLLM / REPLUG: `cepe eval`)"
            )
        self._one_token_ids: dict[str, int | None] = {}  # stop string -> its one token (generate_until)
        unknown = sorted(set(unused) - HARNESS_EXTRA_ARGS)
        if unknown:  # a misspelt argument would otherwise run with its default, unnoticed
            raise ValueError(
                f"cepe harness model: unknown model_args {unknown}; it takes model, method, decoder_window, "
                "chunk_length, rolling_tokens, max_gen_toks, dtype, autocast, device, batch_size, tokenizer, "
                "cepe_init"
            )
        self.method_name = method
        self.decoder_window = int(decoder_window)
        if self.decoder_window < 2:
            raise ValueError("cepe harness model: decoder_window must be at least 2 tokens")
        self.max_gen_toks = int(max_gen_toks)
        bs = 1 if str(batch_size).startswith("auto") else int(batch_size)
        if setup is None:
            import torch

            if not torch.cuda.is_available() and str(device or "cuda").startswith("cuda"):
                if device:  # the harness passes cuda:0 when no device is given
                    warnings.warn(
                        f"cepe harness model: device={device} but CUDA is unavailable; using cpu",
                        stacklevel=2,
                    )
                device = "cpu"
            setup = load_setup(
                str(model),
                [method],
                device=device or "cuda",
                dtype=dtype,
                tokenizer=tokenizer,
                cepe_init=_bool(cepe_init),
                method_options={"cepe": {"chunk_length": chunk_length}} if chunk_length else {},
                autocast_dtype=torch_dtype(autocast) if autocast else None,
                batch_size=bs,
                progress=False,
            )
        self.setup = setup
        self.method = setup.method(method)
        cfg = getattr(setup.cepe_model, "cepe_config", None)
        self.chunk_length = int(chunk_length or getattr(cfg, "chunk_length", 0) or 256)
        self.rolling_tokens = int(rolling_tokens or max(1, self.decoder_window // 2))
        if not 1 <= self.rolling_tokens < self.decoder_window:
            raise ValueError(
                f"cepe harness model: rolling_tokens ({self.rolling_tokens}) must be in [1, decoder_window)"
            )

    # ------------------------------------------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.setup.tokenizer, "name_or_path", "cepe")).replace("/", "__")

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The tokenizer's chat template as text (``--apply_chat_template``)."""
        tok = self.setup.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError(
                "cepe harness model: the tokenizer has no chat template; drop --apply_chat_template"
            )
        return tok.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _request(self, ids: list[int], num_targets: int, window: int) -> Request:
        w = max(window, num_targets + 1)
        return window_request(self.method_name, ids, min(w, len(ids)), num_targets, self.chunk_length)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        if not context:
            return [self.setup.start_id], self.setup.encode(continuation)
        whole = self.setup.encode(context + continuation)
        ctx = self.setup.encode(context)
        if whole[: len(ctx)] != ctx:  # the boundary merged into one token: encode separately
            return ctx, self.setup.encode(continuation)
        return ctx, whole[len(ctx) :]

    def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        reqs = []
        for inst in requests:
            context, continuation = inst.args[0], inst.args[1]
            ctx, cont = self._encode_pair(context, continuation)
            if not cont:
                raise ValueError(f"cepe harness model: empty continuation for context {context[-40:]!r}")
            reqs.append(self._request(ctx + cont, len(cont), self.decoder_window))
        out = []
        for lp, greedy in self.method.score_with_greedy(reqs):
            out.append((float(lp.sum()), greedy))
        return out

    def rolling_requests(self, text: str) -> list[Request]:
        """The scoring requests for ``text`` (see the module docstring); their target counts sum to the
        number of tokens of ``text``."""
        toks = self.setup.encode(text)
        if not toks:
            return []
        e_blocks = list(range(len(toks), 0, -self.rolling_tokens))[::-1]
        reqs = []
        for e in e_blocks:
            s = max(0, e - self.rolling_tokens)
            if s == 0:  # the first block is predicted from the prefix token
                reqs.append(self._request([self.setup.start_id, *toks[:e]], e, self.decoder_window))
            else:
                reqs.append(self._request(toks[:e], e - s, self.decoder_window))
        return reqs

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for inst in requests:
            reqs = self.rolling_requests(inst.args[0])
            out.append(float(sum(float(lp.sum()) for lp in self.method.score(reqs))) if reqs else 0.0)
        return out

    def _one_token(self, text: str) -> int | None:
        """The id of the one token ``text`` encodes to, or None (cached per string)."""
        cache = self._one_token_ids
        if text not in cache:
            ids = self.setup.encode(text)
            cache[text] = ids[0] if len(ids) == 1 and self.setup.decode(ids) == text else None
        return cache[text]

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for inst in requests:
            context, kwargs = inst.args[0], dict(inst.args[1] or {})
            if _bool(kwargs.get("do_sample", False)) and float(kwargs.get("temperature", 0.0) or 0.0) > 0:
                raise ValueError("cepe harness model: only greedy generation; set do_sample: false")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = self.setup.encode(context) if context else [self.setup.start_id]
            w = min(self.decoder_window, len(ids))
            req = window_request(self.method_name, ids, w, 0, self.chunk_length)
            req.max_new_tokens = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            # a stop string that is one token ends generation there (the text is cut at it below anyway)
            req.stop_ids = tuple(single for s in until if s and (single := self._one_token(s)) is not None)
            text = self.setup.decode(self.method.generate(req))
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return out


# ---------------------------------------------------------------------------------------------- tasks


PPL_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {file}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""

MC_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {file}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{text}}}}\\nTopic:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
"""


def write_local_tasks(
    out_dir: str | Path,
    ppl_docs: Sequence[str],
    mc_docs: Sequence[tuple[str, int]],
    choices: Sequence[str],
    prefix: str = "cepe",
) -> dict[str, str]:
    """Write a perplexity task (``<prefix>_ppl``: rolling log-likelihood of ``ppl_docs``) and a
    multiple-choice task (``<prefix>_mc``: ``(text, label index)`` pairs over ``choices``) as JSONL +
    YAML into ``out_dir`` for ``--include_path``. Returns ``{task name: yaml path}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not ppl_docs or not mc_docs:
        raise ValueError("write_local_tasks needs at least one perplexity document and one labelled document")
    for _, label in mc_docs:
        if not 0 <= label < len(choices):
            raise ValueError(f"label {label} is not an index into the {len(choices)} choices")
    files = {}
    for kind, rows, template in (
        ("ppl", [{"text": t} for t in ppl_docs], PPL_TASK),
        ("mc", [{"text": t, "label": y, "choices": list(choices)} for t, y in mc_docs], MC_TASK),
    ):
        name = f"{prefix}_{kind}"
        data = out / f"{name}.jsonl"
        write_text(data, "".join(json.dumps(r) + "\n" for r in rows))
        spec = out / f"{name}.yaml"
        spec.write_text(template.format(name=name, file=json.dumps(str(data.resolve()))), encoding="utf-8")
        files[name] = str(spec)
    return files


def write_bundled_tasks(
    out_dir: str | Path, num_ppl: int = 8, ppl_chars: int = 12000, num_mc: int = 50
) -> dict:
    """Local tasks from the bundled corpora: ``cepe_ppl`` = the first ``num_ppl`` essays (cut to
    ``ppl_chars`` characters), ``cepe_mc`` = BBC News topic classification (``num_mc`` articles, every
    fifth of the corpus order, 5 topics)."""
    from cepe.data.corpora import BBC_LABELS, bbc_news, essays

    ppl = [d["text"][:ppl_chars] for _, d in zip(range(num_ppl), essays())]
    labels = list(BBC_LABELS)
    arts = [d for i, d in enumerate(bbc_news()) if i % 5 == 0]
    step = max(1, len(arts) // num_mc)
    mc = [(" ".join(d["text"].split()), labels.index(d["label"])) for d in arts[::step][:num_mc]]
    return write_local_tasks(out_dir, ppl, mc, labels)
