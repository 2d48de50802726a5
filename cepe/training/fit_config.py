"""The typed config of ``cepe fit-heads`` (:mod:`cepe.training.head_fit`), importable without torch (the CLI
builds its flags from it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HeadFitConfig:
    """``cepe fit-heads``: fit a mixture recipe's heads in full batch (:mod:`cepe.training.head_fit`).

    Attributes:
        recipe: the training stage config (YAML or JSON) whose heads are fitted: a ``cepe`` stage with
            ``output_mix``, ``mix_hidden: false``, and ``train_only`` naming the heads alone.
        output_dir: where the records, the adapter and the report go (default: the recipe's
            ``output_dir`` + ``-fit``).
        steps: record the batches of the recipe's first ``steps`` optimizer steps (default: all its steps).
        held_out_every: every n-th example (index % n == 0) is held out of the fit and only scored (0: none).
        max_iter: L-BFGS iterations at most.
        l2: ridge penalty on the heads' weights in standardised units (half the sum of their squares times
            this, added to the mean NLL; biases free): it keeps an input that barely varies (a context
            length nearly the same in every example) from trading a huge weight against the bias.
        fixed: inputs (by name: ``m1`` … ``mK`` matches, ``n`` the context's length, ``a1`` … ``aK``
            agreements, ``r`` recency, ``u`` the reader's certainty, ``t`` the copy's top share, ``q`` the
            reader's probability of the copy's tokens, ``c`` how often the matched suffix occurs) whose
            weights stay at the start's (zero for new heads), in both heads, or in one as ``copy_head:n`` /
            ``mix_head:n``: an input that tells the recipe's example kinds apart (the length, where one kind
            always has the longest context) without telling where to copy.
        records: the folder of the recorded statistics (default: ``output_dir/stats``): fits with other
            settings can share one recording; records of another recipe are refused.
        compare: other adapters (directories) whose heads' inputs are among the recipe's (one they lack
            weighs zero), scored on the same held-out tokens (their heads alone: over this recipe's reader).
        copy_decays: also fit the heads with the copy's votes weighed by each of these decays
            (``mix_copy_decay``) on the same records, the copy's probabilities recomputed from the examples
            (the reader is not run again), each scored on the held-out tokens as ``decay D``: a sweep of the
            decay for the cost of one recording. The adapter written keeps the recipe's decay.
        task_weights: each example kind's weight in the fit's objective (``lm``, ``copy``, ``recall``,
            ``qa``, ``icl``; 1 for a kind not named): the recipe's mix of kinds decides how far the heads
            trust a match, and reweighing it needs no new recording. The held-out scores stay unweighted.
        device: where the reader records (``cpu``, ``cuda``, ``cuda:1``, ...; default: cuda when available,
            else cpu). The compute dtype follows the recipe's ``bf16`` on that device; the records and the fit
            itself stay on the CPU.
        progress: show a progress bar while recording.
    """

    recipe: str
    output_dir: str | None = None
    steps: int | None = None
    held_out_every: int = 5
    max_iter: int = 300
    l2: float = 1e-4
    fixed: list[str] = field(default_factory=list)
    records: str | None = None
    compare: list[str] = field(default_factory=list)
    copy_decays: list[float] = field(default_factory=list)
    task_weights: dict[str, float] = field(default_factory=dict)
    device: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1 (or unset: all of the recipe's), got {self.steps}")
        if self.held_out_every < 0 or self.held_out_every == 1:
            raise ValueError(
                f"held_out_every must be 0 (nothing held out) or at least 2, got {self.held_out_every}"
            )
        if self.l2 < 0:
            raise ValueError(f"l2 must be at least 0, got {self.l2}")
        if self.max_iter < 1:
            raise ValueError(f"max_iter must be at least 1, got {self.max_iter}")
        negative = {k: v for k, v in self.task_weights.items() if not float(v) >= 0}
        if negative:
            raise ValueError(f"task_weights are numbers ≥ 0, got {negative}")
        bad = [d for d in self.copy_decays if not (float(d) >= 0 and float(d) != float("inf"))]
        if bad:
            raise ValueError(f"copy_decays are finite numbers ≥ 0 (0: every vote the same), got {bad}")
