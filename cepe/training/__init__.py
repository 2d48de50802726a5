"""Training CEPE: encoder masked-LM pre-training, copy warmup, CEPE and CEPED (distillation), on accelerate.

Typical use (or the ``cepe pretrain-encoder`` / ``cepe train`` / ``cepe teacher`` commands)::

    from cepe.training import load_config, train
    cfg = load_config("configs/train/mini/mlm.yaml")
    train(cfg)                      # writes cfg.output_dir; train(cfg, resume=True) continues

Names are imported lazily so that ``cepe --help`` does not pay for torch.
"""

from __future__ import annotations

from cepe.lazy import lazy_getattr

_EXPORTS = {
    "TrainConfig": "config",
    "DataConfig": "config",
    "OptimConfig": "config",
    "load_config": "config",
    "train": "trainer",
    "read_log": "trainer",
    "cosine_schedule": "trainer",
    "run_teacher": "teacher",
    "TeacherStore": "teacher",
    "topk_kl": "losses",
    "teacher_topk": "losses",
    "build_model": "models",
    "StageModule": "models",
    "build_example": "data",
    "chunk_noise_mask": "data",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
