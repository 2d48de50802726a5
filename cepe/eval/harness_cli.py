"""``cepe-lm-eval``: lm-evaluation-harness's command line with the ``cepe`` model registered
(:mod:`cepe.eval.harness`, optional extra ``harness``). Asking it for help loads neither torch nor the
model; ``cepe-lm-eval write-tasks DIR [NUM_PPL PPL_CHARS NUM_MC]`` writes the bundled local tasks."""

from __future__ import annotations

import json
import sys

HELP_FLAGS = frozenset({"-h", "--help"})


def main(argv: list[str] | None = None) -> None:
    """``cepe-lm-eval [lm_eval args]`` (or ``python -m cepe.eval.harness_cli``): the ``lm_eval`` command line
    with ``cepe`` registered; ``cepe-lm-eval write-tasks DIR [NUM_PPL PPL_CHARS NUM_MC]`` writes the
    bundled local tasks (:func:`cepe.eval.harness.write_bundled_tasks`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["write-tasks"]:
        if len(argv) not in (2, 5):
            raise SystemExit("usage: cepe-lm-eval write-tasks DIR [NUM_PPL PPL_CHARS NUM_MC]")
        sizes = [int(x) for x in argv[2:]]
        from cepe.eval.harness import write_bundled_tasks

        print(json.dumps(write_bundled_tasks(argv[1], *sizes), indent=2))
        return
    if not HELP_FLAGS & set(argv):
        import cepe.eval.harness  # noqa: F401  (registers the ``cepe`` model)
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
