"""CEPED teacher pass: the instruction-tuned decoder reads concat(C, X) in its own context; its top-k
next-token probabilities on X are stored on disk for the distillation loss.

Layout of ``teacher_dir``: ``manifest.json`` and ``shard_000000.safetensors``, ... each holding
``probs`` ``(S, n-1, k)`` fp16 and ``indices`` ``(S, n-1, k)`` int32 for examples ``[j·S, (j+1)·S)`` (S =
examples per shard). Row t of an example is the teacher's distribution of decoder token t+1 (the same
positions the student is trained on). Shards are written atomically and skipped when present, so the
pass resumes after an interruption and can be split over processes.

Shape legend: S examples per shard, n decoder tokens, k stored tokens, T = K·L + n window tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from cepe.compute import resolve_bf16
from cepe.fileio import atomic_path, write_json
from cepe.modeling import decoder_logits

from .config import TrainConfig
from .data import corpus_digest, shuffled_window, window_source
from .losses import teacher_topk

MANIFEST = "manifest.json"


def teacher_manifest(cfg: TrainConfig, num_examples: int) -> dict[str, Any]:
    """What the stored outputs depend on; training refuses a teacher directory that disagrees."""
    return {
        "format": "cepe-teacher-1",
        "teacher": cfg.teacher_decoder or ("tiny" if cfg.tiny_decoder is not None else cfg.decoder),
        "n_decoder": cfg.n_decoder,
        "chunk_length": cfg.chunk_length,
        "n_chunks": cfg.n_chunks,
        "top_k": cfg.top_k,
        "examples_per_shard": cfg.teacher_examples_per_shard,
        "num_examples": int(num_examples),
        "data": cfg.to_dict()["data"],
        "data_digest": corpus_digest(cfg),
    }


def _differs(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The manifest keys whose values differ (``num_examples`` aside; a ``data_digest`` that the older
    manifest lacks is not compared: written before digests were recorded)."""
    return sorted(
        k
        for k in new
        if k != "num_examples" and not (k == "data_digest" and k not in old) and old.get(k) != new[k]
    )


def _shard_path(root: Path, j: int) -> Path:
    return root / f"shard_{j:06d}.safetensors"


def run_teacher(
    cfg: TrainConfig,
    num_examples: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
    device: str | torch.device | None = None,
) -> Path:
    """Compute and store the teacher's top-k distributions for the first ``num_examples`` CEPED examples.

    Args:
        cfg: the ``ceped`` stage config (layout, data, ``teacher_dir``, ``top_k``).
        num_examples: default ``cfg.steps × cfg.batch_size`` (every example training will read).
        rank, world_size: this process takes shards ``rank, rank + world_size, ...``.
        device: where the teacher runs (default CPU).

    Returns:
        ``teacher_dir``.

    Raises:
        ValueError: the window does not fit the teacher's positions, or ``teacher_dir`` holds outputs of
            another configuration.
    """
    from tqdm.auto import tqdm

    if cfg.stage != "ceped":
        raise ValueError(f"the teacher pass belongs to stage ceped, the config is for {cfg.stage!r}")
    if cfg.online_teacher:
        raise ValueError(
            "this config has online_teacher: true (the teacher runs during training); no pass is needed"
        )
    total = int(num_examples if num_examples is not None else cfg.steps * cfg.batch_size)
    root = Path(cfg.teacher_dir)
    root.mkdir(parents=True, exist_ok=True)
    _check_and_write_manifest(cfg, root, total, write=rank == 0)

    dev = torch.device(device or "cpu")
    teacher = _load_teacher(cfg, dev)
    source = window_source(cfg, int(teacher.config.vocab_size))
    per = cfg.teacher_examples_per_shard
    shards = [j for j in range(-(-total // per)) if j % world_size == rank]
    todo = [j for j in shards if not _shard_path(root, j).is_file()]
    bar = tqdm(total=len(todo), desc="teacher", unit="shard", disable=not progress)
    for j in todo:
        shard = _teacher_shard(cfg, teacher, source, range(j * per, (j + 1) * per), dev)
        with atomic_path(_shard_path(root, j)) as tmp:
            save_file(shard, tmp, metadata={"format": "pt"})
        bar.update(1)
    bar.close()
    return root


def _check_and_write_manifest(cfg: TrainConfig, root: Path, total: int, write: bool) -> None:
    """Refuse a ``root`` that holds outputs of another configuration; (``write``) record the manifest, its
    ``num_examples`` the larger of ``total`` and what ``root`` already covers."""
    manifest = teacher_manifest(cfg, total)
    mpath = root / MANIFEST
    if mpath.is_file():
        old = json.loads(mpath.read_text())
        diff = _differs(old, manifest)
        if diff:
            raise ValueError(
                f"{root} holds teacher outputs of another configuration (differs in {diff}); use a new "
                "teacher_dir or delete it"
            )
        manifest["num_examples"] = max(total, int(old.get("num_examples", 0)))
    if write:
        write_json(mpath, manifest, indent=2, sort_keys=True)


def _load_teacher(cfg: TrainConfig, dev: torch.device) -> torch.nn.Module:
    """The teacher decoder on ``dev``; refuses one with fewer positions than the window."""
    from .models import build_decoder, decoder_vocab_size

    teacher = build_decoder(cfg, cfg.teacher_decoder).to(dev)
    vocab, own = int(teacher.config.vocab_size), decoder_vocab_size(cfg)
    if vocab != own:  # its top-k ids index the student's logits; its windows are the student's
        raise ValueError(
            f"teacher_decoder {cfg.teacher_decoder} has a {vocab}-token vocabulary but the student's decoder "
            f"has {own}: the teacher's top-k token ids index the student's logits and it reads the student's "
            "windows, so it must have the student's tokenizer and vocabulary size (a model of the same "
            "family padded to another size is refused too)"
        )
    limit = getattr(teacher.config, "max_position_embeddings", None)
    if limit is not None and cfg.window_length > int(limit):
        raise ValueError(
            f"the teacher reads concat(C, X) = {cfg.window_length} tokens but has {limit} positions; "
            "lower n_decoder or n_chunks × chunk_length"
        )
    return teacher


def _teacher_shard(
    cfg: TrainConfig, teacher: torch.nn.Module, source: Any, examples: range, dev: torch.device
) -> dict[str, torch.Tensor]:
    """The teacher's top-k ``probs`` and ``indices`` (E, n-1, k) on the decoder part X of the windows
    ``examples`` (the teacher reads concat(C, X)), ``micro_batch_size`` windows per forward."""
    m = cfg.n_chunks * cfg.chunk_length
    probs, idx = [], []
    for start in range(examples.start, examples.stop, cfg.micro_batch_size):
        stop = min(start + cfg.micro_batch_size, examples.stop)
        # (B, T): the windows as the student's examples read them (data.shuffle permutes some)
        ids = torch.stack(
            [torch.as_tensor(shuffled_window(cfg, source[i], i)) for i in range(start, stop)]
        ).to(dev)
        with (
            torch.no_grad(),
            torch.autocast(dev.type, dtype=torch.bfloat16, enabled=resolve_bf16(cfg.bf16, dev)),
        ):
            hidden = teacher.get_decoder()(input_ids=ids).last_hidden_state[:, m:-1]  # (B, n-1, D)
            logits = decoder_logits(teacher, hidden)  # the student's head, soft-capping included
        p, i = teacher_topk(logits, cfg.top_k)
        probs.append(p.cpu())
        idx.append(i.cpu())
    return {"probs": torch.cat(probs), "indices": torch.cat(idx)}


class TeacherStore:
    """Read access to a teacher directory written by :func:`run_teacher`.

    Raises:
        ValueError: missing directory or manifest, or a layout that differs from ``cfg``.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.root = Path(cfg.teacher_dir)
        mpath = self.root / MANIFEST
        if not mpath.is_file():
            raise ValueError(
                f"no teacher outputs in {self.root}: run `cepe teacher --config FILE` with this config first"
            )
        self.manifest = json.loads(mpath.read_text())
        want = teacher_manifest(cfg, 0)
        diff = _differs(self.manifest, want)
        if diff:
            raise ValueError(
                f"teacher outputs in {self.root} were computed for another configuration (differs in {diff}); "
                "rerun `cepe teacher` into a new teacher_dir"
            )
        self.per = int(self.manifest["examples_per_shard"])
        self.num_examples = int(self.manifest["num_examples"])
        self._cache: tuple[int, dict[str, torch.Tensor]] | None = None

    def missing_shards(self, count: int) -> list[str]:
        """The shard files of the first ``count`` examples that are not (yet) in the directory: a teacher
        pass stopped early, or one of several processes still running."""
        return [
            _shard_path(self.root, j).name
            for j in range(-(-int(count) // self.per))
            if not _shard_path(self.root, j).is_file()
        ]

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs (n-1, k) fp16, indices (n-1, k) int64)`` of global example ``index``."""
        j, r = divmod(int(index), self.per)
        if self._cache is None or self._cache[0] != j:
            path = _shard_path(self.root, j)
            if not path.is_file():
                raise ValueError(
                    f"teacher shard {path.name} (example {index}) is missing in {self.root}: the teacher pass "
                    f"covers {self.num_examples} examples; rerun `cepe teacher` (it resumes) with enough steps"
                )
            self._cache = (j, load_file(path))
        shard = self._cache[1]
        return shard["probs"][r], shard["indices"][r].long()
