"""scripts/train_chain.sh and scripts/rebuild_choice.sh refuse to start a second chain (two trainers on
the same stage directories) while one runs, and say which."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tree(tmp_path: Path) -> Path:
    """A scratch checkout with the scripts, one recipe config and an empty virtual environment."""
    for rel in (
        "scripts/train_chain.sh",
        "scripts/fast_alloc.sh",
        "scripts/rebuild_choice.sh",
        "scripts/recipe_corpus.sh",
        "scripts/pidfile.sh",
        "configs/train/recipe/fast_warmup.yaml",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    (tmp_path / ".venv/bin").mkdir(parents=True)
    (tmp_path / ".venv/bin/activate").write_text("")
    (tmp_path / "runs/recipe").mkdir(parents=True)
    return tmp_path


def test_a_second_chain_is_refused_while_one_runs(tmp_path):
    """A live chain (a process running ``run_chain``) refuses a second; a pid file whose pid a later boot
    gave to another process (here the test's own) does not."""
    root = _tree(tmp_path)
    chain = subprocess.Popen(
        ["bash", "-c", "run_chain() { sleep 60; }; run_chain"]
    )  # stands in for the chain
    try:
        (root / "runs/recipe/chain.pid").write_text(str(chain.pid))
        proc = subprocess.run(
            ["bash", "scripts/train_chain.sh", "fast_warmup"], cwd=root, capture_output=True, text=True
        )
        assert proc.returncode == 2
        assert f"a chain is running already (pid {chain.pid}" in proc.stderr
        assert not (root / "runs/recipe/chain.log").exists()  # nothing started
    finally:
        chain.kill()
        chain.wait()
    (root / "runs/recipe/chain.pid").write_text(str(os.getpid()))  # alive, but no chain
    proc = subprocess.run(
        ["bash", "scripts/train_chain.sh", "fast_warmup"], cwd=root, capture_output=True, text=True
    )
    assert "a chain is running already" not in proc.stderr


def test_the_rebuild_is_not_started_twice(tmp_path):
    root = _tree(tmp_path)
    (root / "runs/recipe/rebuild.pid").write_text(str(os.getpid()))
    proc = subprocess.run(["bash", "scripts/rebuild_choice.sh"], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0 and f"already running (pid {os.getpid()})" in proc.stdout
    assert not (root / "runs/recipe/rebuild.log").exists()


def _wait(pidfile: Path, seconds: float = 60.0) -> None:
    pid = int(pidfile.read_text())
    for _ in range(int(seconds / 0.05)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"{pidfile} still running after {seconds} s")


def _with_stand_in_cepe(tmp_path: Path, code: int) -> Path:
    """A scratch tree whose ``cepe`` (on the PATH the environment's activation sets) exits with ``code``,
    with every recipe config and a prepared-data marker, so the chains start their stages at once."""
    root = _tree(tmp_path)
    shutil.copytree(ROOT / "configs/train/recipe", root / "configs/train/recipe", dirs_exist_ok=True)
    (root / "runs/data/mini").mkdir(parents=True)
    (root / "runs/data/mini/summary.json").write_text("{}")
    fake = root / "fakebin/cepe"
    fake.parent.mkdir()
    fake.write_text(f"#!/usr/bin/env bash\nexit {code}\n")
    fake.chmod(0o755)
    (root / ".venv/bin/activate").write_text(f'export PATH="{fake.parent}:$PATH"\n')
    return root


def _run_chain_with_exit(tmp_path: Path, code: int) -> str:
    """Run a two-stage chain whose ``cepe train`` exits with ``code``; return the chain's log."""
    root = _with_stand_in_cepe(tmp_path, code)
    subprocess.run(
        ["bash", "scripts/train_chain.sh", "fast_warmup", "fast_direct_copy"], cwd=root, check=True
    )
    _wait(root / "runs/recipe/chain.pid")  # the chain runs in the background
    return (root / "runs/recipe/chain.log").read_text()


def test_a_stage_stopped_by_a_signal_stops_the_chain_as_a_stop_not_a_failure(tmp_path):
    log = _run_chain_with_exit(tmp_path, 128 + 15)  # cepe train after SIGTERM and its checkpoint
    assert "fast_warmup: stopped by signal 15 before its end" in log
    assert "failed" not in log and "fast_direct_copy" not in log  # the next stage does not start


def test_a_failing_stage_is_reported_with_its_exit_code(tmp_path):
    log = _run_chain_with_exit(tmp_path, 1)
    assert "fast_warmup: failed (exit 1), see runs/recipe/fast_warmup.log" in log
    assert "fast_direct_copy" not in log


@pytest.mark.parametrize(
    ("route", "later"),
    [
        ([], "fast_direct_8kd fast_fold fast_fold_qa fast_fold_qa2 fast_fold_gates fast_fold_break_only"),
        (
            ["run"],
            "fast_direct_8kd_run fast_fold_run fast_fold_qa_run fast_fold_qa2_run fast_fold_gates_run "
            "fast_fold_break_only_run",
        ),
    ],
)
def test_the_rebuild_chains_the_nine_stages_and_stops_cleanly_with_them(tmp_path, route, later):
    """``rebuild_choice.sh`` (and ``rebuild_choice.sh run``, the route with run biases from the 8K stage on)
    starts the route's nine stages (each config must exist, or the chain refuses it) and, when a stage is
    stopped, says which parent is not done instead of averaging."""
    root = _with_stand_in_cepe(tmp_path, 128 + 15)
    proc = subprocess.run(
        ["bash", "scripts/rebuild_choice.sh", *route], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    _wait(root / "runs/recipe/rebuild.pid")
    log = (root / "runs/recipe/rebuild.log").read_text()
    stages = f"fast_warmup fast_direct_copy fast_direct_recall2 {later}"
    assert f"started the chain {stages} (pid" in log
    parent = "fast_fold_qa2_run" if route else "fast_fold_qa2"
    assert f"{parent} is not done: the chain stopped" in log
    assert "fast_warmup: stopped by signal 15" in (root / "runs/recipe/chain.log").read_text()


NINE = (
    "fast_warmup fast_direct_copy fast_direct_recall2 fast_direct_8kd fast_fold fast_fold_qa fast_fold_qa2 "
    "fast_fold_gates fast_fold_break_only"
).split()


def _done_up_to_the_average(tmp_path: Path, stages: list[str], probed: tuple[str, ...]) -> Path:
    """A stand-in tree where ``stages`` are done, the average is written, ``fast_soup_linux_s2``'s data set
    is prepared and the probes of ``probed`` (names under ``results/recipe/``, step 40) exist."""
    root = _with_stand_in_cepe(tmp_path, 128 + 15)
    for name in stages:
        (root / f"runs/recipe/{name}").mkdir(parents=True)
        (root / f"runs/recipe/{name}/status.json").write_text('{"state": "done"}')
    (root / "runs/soup/qa2_gates_break").mkdir(parents=True)
    (root / "runs/soup/qa2_gates_break/cepe_config.json").write_text("{}")
    (root / "runs/data/mini_linux").mkdir(parents=True)  # fast_soup_linux_s2's data set, prepared
    (root / "runs/data/mini_linux/summary.json").write_text("{}")
    for name in probed:
        for rel in ("copy_val/copy.json", "fixedppl/fixedppl.json"):
            path = root / f"results/recipe/{name}/step040" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}")
    return root


def test_the_rebuild_trains_the_choice_over_the_average_and_stops_cleanly_with_it(tmp_path):
    """With the nine stages done, the average written and probed, ``rebuild_choice.sh`` goes on to the
    stages from it to the validation choice (``fast_soup_run`` ... ``fast_soup_linux_s2``) and, when the
    first is stopped, says so instead of probing; the route with run biases has no such stages."""
    root = _done_up_to_the_average(tmp_path, NINE, ("soup_qa2_gates_break_rebuilt",))
    proc = subprocess.run(["bash", "scripts/rebuild_choice.sh"], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    _wait(root / "runs/recipe/rebuild.pid")
    log = (root / "runs/recipe/rebuild.log").read_text()
    assert (
        "rebuilt: runs/soup/qa2_gates_break, probes in results/recipe/soup_qa2_gates_break_rebuilt/step040"
        in log
    )
    assert "started the chain fast_soup_run fast_soup_run2 fast_soup_run3 fast_soup_linux_s2 (pid" in log
    assert "fast_soup_run is not done: the chain stopped" in log
    assert "fast_soup_run: stopped by signal 15" in (root / "runs/recipe/chain.log").read_text()
    assert not (root / "results/recipe/fast_soup_linux_s2_rebuilt").exists()


def test_the_rebuild_ends_with_the_mixing_head_over_the_choice(tmp_path):
    """With the choice trained and probed, ``rebuild_choice.sh`` trains the output mixture's head over it
    (``mix_choice``) and, when that stage is stopped, says so instead of probing it."""
    choice = ["fast_soup_run", "fast_soup_run2", "fast_soup_run3", "fast_soup_linux_s2"]
    root = _done_up_to_the_average(
        tmp_path, NINE + choice, ("soup_qa2_gates_break_rebuilt", "fast_soup_linux_s2_rebuilt")
    )
    proc = subprocess.run(["bash", "scripts/rebuild_choice.sh"], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    _wait(root / "runs/recipe/rebuild.pid")
    log = (root / "runs/recipe/rebuild.log").read_text()
    assert "rebuilt: runs/recipe/fast_soup_linux_s2/checkpoints/step_000040/adapter" in log
    assert "started the chain mix_choice (pid" in log
    assert "mix_choice is not done: the chain stopped" in log
    assert not (root / "results/recipe/mix_choice").exists()


def test_the_rebuild_refuses_an_unknown_route(tmp_path):
    root = _with_stand_in_cepe(tmp_path, 0)
    proc = subprocess.run(
        ["bash", "scripts/rebuild_choice.sh", "fast"], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "usage: bash scripts/rebuild_choice.sh [run]" in proc.stderr
    assert not (root / "runs/recipe/rebuild.log").exists()


@pytest.mark.parametrize(
    ("stages", "prepared"),
    [
        (["fast_warmup"], []),
        (["fast_soup_linux"], ["mini_linux"]),
        (["fast_soup_linux2", "fast_soup_linux2_run"], ["mini_linux_all"]),
        (["fast_soup_linux", "fast_soup_linux2"], ["mini_linux", "mini_linux_all"]),
        (["fast_soup_linux_all"], ["mini_linux_all"]),  # its own set, not the extended config's
    ],
)
def test_the_chain_prepares_the_wider_sets_its_stages_name_and_no_other(tmp_path, stages, prepared):
    """A stage whose set (its config's ``corpus``, else the one of the config it extends) is
    ``runs/data/mini_linux`` gets the first 1,000 kernel documents, one whose set is
    ``runs/data/mini_linux_all`` all of them; a name that only begins like another does not count."""
    root = _with_stand_in_cepe(tmp_path, 0)
    calls = root / "calls.txt"
    (root / "fakebin/cepe").write_text(
        f'#!/usr/bin/env bash\necho "$*" >> {calls}\n[ "$1" = prepare-data ] && exit 0\nexit 143\n'
    )
    proc = subprocess.run(
        ["bash", "scripts/train_chain.sh", *stages], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    _wait(root / "runs/recipe/chain.pid")
    made = [
        line.split("--out runs/data/")[1].split()[0]
        for line in calls.read_text().splitlines()
        if line.startswith("prepare-data")
    ]
    assert made == prepared
    for line in calls.read_text().splitlines():
        if "--out runs/data/mini_linux " in line + " ":
            assert "--max-docs 1000" in line
        if "mini_linux_all" in line and line.startswith("prepare-data"):
            assert "--max-docs" not in line


def test_a_stage_gets_the_set_of_the_config_it_extends_and_comments_do_not_count(tmp_path):
    """A config without a ``corpus`` of its own trains on the one of the config it extends (two levels up
    here); a set named only in a comment is not prepared."""
    root = _with_stand_in_cepe(tmp_path, 0)
    recipe = root / "configs/train/recipe"
    (recipe / "child_a.yaml").write_text("extends: fast_soup_linux.yaml\noutput_dir: runs/recipe/child_a\n")
    (recipe / "child_b.yaml").write_text(
        "# not runs/data/mini_linux_all: corpus: runs/data/mini_linux_all\nextends: child_a.yaml\n"
    )
    calls = root / "calls.txt"
    (root / "fakebin/cepe").write_text(
        f'#!/usr/bin/env bash\necho "$*" >> {calls}\n[ "$1" = prepare-data ] && exit 0\nexit 143\n'
    )
    proc = subprocess.run(
        ["bash", "scripts/train_chain.sh", "child_b"], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    _wait(root / "runs/recipe/chain.pid")
    made = [line for line in calls.read_text().splitlines() if line.startswith("prepare-data")]
    assert len(made) == 1 and "--out runs/data/mini_linux " in made[0] + " "


_STAND_IN_EVAL = r"""#!/usr/bin/env python3
# cepe eval KIND --model A --config C --out DIR ...: record the call, write what the summary reads
import json, pathlib, sys
args = sys.argv[1:]
out = pathlib.Path(args[args.index("--out") + 1])
with open(pathlib.Path(__file__).parent / "calls", "a") as fh:
    fh.write(out.name + "\n")
out.mkdir(parents=True, exist_ok=True)
kind = args[1]
if kind == "needle":
    rows = [{"setting": {"total": t}, "value": 100.0} for t in (2048, 4096, 8192)]
elif kind == "lm":
    rows = [{"setting": {"domain": "avg"}, "value": 20.0}]
else:
    rows = [{"setting": {"order": "natural"}, "value": 2.0}]
(out / f"{kind}.json").write_text(json.dumps({"rows": rows}))
"""


def _probe_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A scratch checkout with scripts/probe_stage.sh, a stand-in ``cepe`` that records each evaluation's
    output folder, and a stand-in calibration script; returns the tree and the record of calls."""
    root = tmp_path
    (root / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/probe_stage.sh", root / "scripts/probe_stage.sh")
    (root / "scripts/calibrate_context_scale.sh").write_text(
        'printf "| scale |\\n| 1 |\\n" > "$2/calibrate.md"; echo calibrate >> fakebin/calls\n'
    )
    fake = root / "fakebin/cepe"
    fake.parent.mkdir()
    fake.write_text(_STAND_IN_EVAL)
    fake.chmod(0o755)
    (root / "adapter").mkdir()
    return root, fake.parent / "calls"


def _probe(root: Path, **env: str) -> subprocess.CompletedProcess:
    path = f"{root / 'fakebin'}:{os.environ['PATH']}"
    return subprocess.run(
        ["bash", "scripts/probe_stage.sh", "stage", "40"],
        cwd=root,
        env={**os.environ, "PATH": path, "ADAPTER": "adapter", **env},
        capture_output=True,
        text=True,
    )


def test_probe_stage_runs_every_probe_and_skip_done_keeps_those_already_there(tmp_path):
    root, calls = _probe_tree(tmp_path)
    every = [
        "needle_encoder",
        "copy",
        "calibrate",
        "needle_val2",
        "needle_val3",
        "needle_val4",
        "copy_val",
        "lm_val_long",
    ]
    proc = _probe(root)
    assert proc.returncode == 0, proc.stderr
    assert calls.read_text().split() == every
    assert "reported needle {2048: 100, 4096: 100, 8192: 100} mean 100" in proc.stdout
    # a second run repeats them all by default; SKIP_DONE=1 runs only the probes whose results are missing
    calls.unlink()
    shutil.rmtree(root / "results/recipe/stage/step040/copy_val")
    assert _probe(root).returncode == 0 and calls.read_text().split() == every
    calls.unlink()
    shutil.rmtree(root / "results/recipe/stage/step040/copy_val")
    proc = _probe(root, SKIP_DONE="1")
    assert proc.returncode == 0, proc.stderr
    assert calls.read_text().split() == ["copy_val"]
    assert "copy_val natural 2.0" in proc.stdout


_FAKE_CEPE = r"""#!/usr/bin/env bash
# stands in for cepe: records its arguments and writes what each command would
echo "cepe $*" >> "$CALLS"
[ -z "${LD_PRELOAD:-}" ] || echo "$1 $LD_PRELOAD" >> "$CALLS.preload"
case "$1" in
  fit-heads) mkdir -p "runs/recipe/$(basename "$3" .yaml)-fit/adapter"
             echo '{}' > "runs/recipe/$(basename "$3" .yaml)-fit/adapter/cepe_config.json"
             echo '# fit' > "runs/recipe/$(basename "$3" .yaml)-fit/fit.md" ;;
  export) mkdir -p "$5" && echo '{}' > "$5/cepe_config.json" ;;
  prepare-data) mkdir -p runs/data/mini_kernel && echo '{}' > runs/data/mini_kernel/summary.json ;;
  eval) for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
        cfg=$(basename "$out")
        if [ "$cfg" = "${FAIL_EVAL:-}" ]; then echo "error: $cfg cannot be computed" >&2; exit 1; fi
        if [ "$cfg" = "${SIGNAL_EVAL:-}" ]; then kill -TERM $$; fi
        mkdir -p "$out"
        cp "$BASE/$cfg/"*.json "$out/"
        if [ -n "${SKEW:-}" ] && [ -n "${LD_PRELOAD:-}" ]; then  # another value under a preload
          sed -i 's/"value": \([0-9]\)/"value": 9\1/' "$out/"*.json
        fi ;;
esac
"""


def _heads_tree(tmp_path: Path, env: str = "") -> tuple[Path, Path, Path]:
    """A tree for heads_and_validate.sh with a stand-in cepe: (root, the stand-in, its calls file); ``env``
    adds variable assignments to what the stand-in venv exports."""
    root = _tree(tmp_path)
    for rel in ("scripts/heads_and_validate.sh", "scripts/eval_val.sh", "scripts/val_verdict.py"):
        shutil.copy(ROOT / rel, root / rel)
    shutil.copytree(ROOT / "configs/train/recipe", root / "configs/train/recipe", dirs_exist_ok=True)
    base = root / "results/recipe/mix_fit3/fit150_int8"
    shutil.copytree(ROOT / "results/recipe/mix_fit3/fit150_int8", base)
    (root / "adapters/smollm2-135m-cepe").mkdir(parents=True)
    fake = root / "fakebin/cepe"
    fake.parent.mkdir()
    fake.write_text(_FAKE_CEPE)
    fake.chmod(0o755)
    calls = root / "calls.txt"
    (root / ".venv/bin/activate").write_text(
        f'export PATH="{fake.parent}:$PATH" CALLS="{calls}" BASE="{base}" PYTHONPATH="{ROOT}" {env}\n'
    )
    return root, fake, calls


def test_heads_and_validate_runs_each_step_once_and_judges_the_result(tmp_path):
    """``heads_and_validate.sh`` fits, exports, runs every validation config and the verdict for each heads
    recipe, preparing the kernel data where the recipe reads it; run again, it redoes nothing."""
    root, _, calls = _heads_tree(tmp_path)
    for _ in range(2):
        proc = subprocess.run(
            ["bash", "scripts/heads_and_validate.sh", "mix_fit14", "mix_fit14k"],
            cwd=root,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        _wait(root / "runs/recipe/heads.pid", 120)
    log = (root / "runs/recipe/heads.log").read_text()
    made = calls.read_text().splitlines()
    assert len([c for c in made if c.startswith("cepe fit-heads")]) == 2  # once per recipe, not on the rerun
    assert (
        "cepe fit-heads --recipe configs/train/recipe/mix_fit14k.yaml --compare adapters/smollm2-135m-cepe"
        in (calls.read_text())
    )
    assert len([c for c in made if c.startswith("cepe prepare-data")]) == 1  # mix_fit14k reads mini_kernel
    evals = [c for c in made if c.startswith("cepe eval")]
    assert len(evals) == 2 * 9 and all(
        "--model runs/recipe/mix_fit14" in c and "-fit/int8" in c for c in evals
    )
    for name in ("mix_fit14", "mix_fit14k"):
        assert (root / f"results/recipe/{name}/fit150_int8/needle_val4/needle.json").is_file()
        verdict = (root / f"results/recipe/{name}/val_verdict.md").read_text()
        assert verdict.rstrip().endswith("no (better on none)")  # the shipped adapter's own numbers: a tie
        assert f"{name}: done" in log


def test_heads_recipe_that_inherits_the_kernel_corpus_gets_it_prepared(tmp_path):
    """``mix_fit16`` reads ``runs/data/mini_kernel`` through ``extends: mix_fit14k.yaml`` (it never names
    it): the corpus is prepared all the same (before, only a recipe naming it did, and the chain's
    ``heads:mix_fit16`` failed on a fresh machine), and a fit killed before its report is run again, and
    then exported and evaluated again (what was there was the earlier fit's)."""
    root, _, calls = _heads_tree(tmp_path)
    run = ["bash", "scripts/heads_and_validate.sh", "mix_fit16"]
    assert subprocess.run(run, cwd=root, capture_output=True, text=True).returncode == 0
    _wait(root / "runs/recipe/heads.pid", 120)
    made = calls.read_text().splitlines()
    assert len([c for c in made if c.startswith("cepe prepare-data")]) == 1
    assert (root / "runs/data/mini_kernel/summary.json").is_file()
    (root / "runs/recipe/mix_fit16-fit/fit.md").unlink()  # killed after the adapter, before the report
    calls.unlink()
    assert subprocess.run(run, cwd=root, capture_output=True, text=True).returncode == 0
    _wait(root / "runs/recipe/heads.pid", 120)
    assert [c.split()[1] for c in calls.read_text().splitlines()] == ["fit-heads", "export"] + ["eval"] * 9


def test_results_older_than_the_fit_are_an_earlier_fits_and_are_evaluated_again(tmp_path):
    """On a machine that trains the line again, a heads entry the repository has judged before finds the
    committed results of the earlier fit: they are older than this fit, so this fit is evaluated (its
    verdict is its own, not the earlier fit's) and, once evaluated, not again at the next rerun."""
    root, _, calls = _heads_tree(tmp_path)
    res = root / "results/recipe/mix_fit16/fit150_int8"
    for cfg in ("qa_val", "lm_val"):  # the earlier fit's results, as a clone has them
        shutil.copytree(root / "results/recipe/mix_fit3/fit150_int8" / cfg, res / cfg)
    earlier = (res / "qa_val/qa.json").read_text()
    (res / "qa_val/qa.json").write_text(earlier.replace('"value": ', '"value": 1'))
    time.sleep(0.01)
    run = ["bash", "scripts/heads_and_validate.sh", "mix_fit16"]
    assert subprocess.run(run, cwd=root, capture_output=True, text=True).returncode == 0
    _wait(root / "runs/recipe/heads.pid", 120)
    made = calls.read_text().splitlines()
    assert [c.split()[1] for c in made if c.split()[1] in ("fit-heads", "export", "eval")] == [
        "fit-heads",
        "export",
    ] + ["eval"] * 9
    log = (root / "runs/recipe/heads.log").read_text()
    assert "mix_fit16: qa_val holds a result older than this fit" in log
    assert "mix_fit16: lm_val holds a result older than this fit" in log
    assert (res / "qa_val/qa.json").read_text() == earlier  # this fit's (the stand-in's) numbers
    calls.unlink()
    assert subprocess.run(run, cwd=root, capture_output=True, text=True).returncode == 0
    _wait(root / "runs/recipe/heads.pid", 120)
    assert not calls.exists() or not [c for c in calls.read_text().splitlines() if "eval" in c]
    assert "older than this fit" not in (root / "runs/recipe/heads.log").read_text()[len(log) :]


def test_heads_and_validate_goes_on_past_a_failed_evaluation_and_logs_a_stop(tmp_path):
    """One evaluation that fails is logged and the rest run (the verdict names it as not evaluated and
    rules the replacement out); an error elsewhere stops the pipeline with a line in the log."""
    root, fake, calls = _heads_tree(tmp_path, "FAIL_EVAL=fixedppl_val_short_kernel")
    run = ["bash", "scripts/heads_and_validate.sh", "mix_fit14"]
    assert subprocess.run(run, cwd=root, capture_output=True, text=True).returncode == 0
    _wait(root / "runs/recipe/heads.pid", 120)
    log = (root / "runs/recipe/heads.log").read_text()
    assert "mix_fit14: fixedppl_val_short_kernel failed" in log and "mix_fit14: done" in log
    assert len([c for c in calls.read_text().splitlines() if c.startswith("cepe eval")]) == 9  # the rest ran
    verdict = (root / "results/recipe/mix_fit14/val_verdict.md").read_text()
    assert "not evaluated: fixedppl_val_short_kernel" in verdict.rstrip().splitlines()[-1]
    # the export fails: the pipeline stops there and says so
    shutil.rmtree(root / "runs/recipe/mix_fit14-fit/int8")
    fake.write_text(_FAKE_CEPE.replace('  export) mkdir -p "$5"', '  export) exit 3; mkdir -p "$5"'))
    assert subprocess.run(run, cwd=root, capture_output=True, text=True).returncode == 0
    _wait(root / "runs/recipe/heads.pid", 120)
    tail = (root / "runs/recipe/heads.log").read_text()[len(log) :]
    assert "stopped by an error (exit 3)" in tail and "mix_fit14: done" not in tail


def test_an_evaluation_stopped_by_a_signal_stops_the_heads_step(tmp_path):
    """An evaluation ended by a signal (SIGTERM to a running ``cepe eval``) is not a failed evaluation to
    go past: the step stops with the signal's status (the chain then stops, to be run again) and judges
    nothing; run again, it evaluates what is missing."""
    root, _, calls = _heads_tree(tmp_path, "SIGNAL_EVAL=lm_val")
    run = ["bash", "scripts/heads_and_validate.sh", "mix_fit14"]
    proc = subprocess.run(
        run, cwd=root, capture_output=True, text=True, env={**os.environ, "FOREGROUND": "1"}
    )
    assert proc.returncode == 128 + 15
    log = (root / "runs/recipe/heads.log").read_text()
    assert "mix_fit14: lm_val stopped by signal 15" in log and "mix_fit14: done" not in log
    evals = [c for c in calls.read_text().splitlines() if c.startswith("cepe eval")]
    assert "lm_val" in evals[-1] and not (root / "results/recipe/mix_fit14/val_verdict.md").exists()


def _heads_mix_fit14(root: Path, env: dict[str, str]) -> None:
    """Start ``heads_and_validate.sh mix_fit14`` in ``root`` with ``env`` and wait for it to end."""
    proc = subprocess.run(
        ["bash", "scripts/heads_and_validate.sh", "mix_fit14"],
        cwd=root,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    _wait(root / "runs/recipe/heads.pid", 120)


def test_heads_and_validate_refuses_unknown_recipes_and_gives_up_waiting_without_a_chain(tmp_path):
    root = _tree(tmp_path)
    shutil.copy(ROOT / "scripts/heads_and_validate.sh", root / "scripts/heads_and_validate.sh")
    shutil.copytree(ROOT / "configs/train/recipe", root / "configs/train/recipe", dirs_exist_ok=True)
    proc = subprocess.run(
        ["bash", "scripts/heads_and_validate.sh", "nope"], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "no such heads recipe: configs/train/recipe/nope.yaml" in proc.stderr
    _heads_mix_fit14(root, {**os.environ, "WAIT_FOR": "read_lm4"})
    log = (root / "runs/recipe/heads.log").read_text()
    assert "the chain is not running and read_lm4 is not done" in log and "fit-heads" not in log


def test_a_chain_runs_its_heads_entries_in_the_foreground_between_stages(tmp_path):
    """``heads:NAME`` in a chain fits, stores, validates and judges NAME after the stage before it and
    before the stage after it (never beside it); run again, the chain redoes nothing; a heads entry that
    fails stops the chain before the next stage."""
    root, fake, calls = _heads_tree(tmp_path)
    (root / "runs/data/mini").mkdir(parents=True)
    (root / "runs/data/mini/summary.json").write_text("{}")
    train = (
        '  train) for a in "$@"; do [ "$prev" = --output-dir ] && o=$a; prev=$a; done\n'
        '         mkdir -p "$o" && echo \'{"state": "done"}\' > "$o/status.json" ;;\n'
    )
    fake.write_text(_FAKE_CEPE.replace('case "$1" in\n', 'case "$1" in\n' + train, 1))
    chain = ["bash", "scripts/train_chain.sh", "read_lm6", "heads:mix_fit16", "read_lm7"]
    for _ in range(2):
        proc = subprocess.run(chain, cwd=root, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        _wait(root / "runs/recipe/chain.pid", 120)
    made = [c for c in calls.read_text().splitlines() if not c.startswith("cepe prepare-data")]
    first_train = made.index(
        "cepe train --config configs/train/recipe/read_lm6.yaml --output-dir runs/recipe/read_lm6 --no-progress"
    )
    fit = next(
        i
        for i, c in enumerate(made)
        if c.startswith("cepe fit-heads --recipe configs/train/recipe/mix_fit16.yaml")
    )
    evals = [i for i, c in enumerate(made) if c.startswith("cepe eval")]
    second = next(i for i, c in enumerate(made) if "configs/train/recipe/read_lm7.yaml" in c)
    assert first_train < fit < min(evals) and max(evals) < second
    assert len(evals) == 9 and len(made) == 2 + 1 + 1 + 9  # nothing again on the second run
    log = (root / "runs/recipe/chain.log").read_text()
    assert "mix_fit16: judged (results/recipe/mix_fit16/val_verdict.md)" in log
    assert (root / "results/recipe/mix_fit16/val_verdict.md").is_file()
    assert "mix_fit16: done" in (root / "runs/recipe/heads.log").read_text()
    # the export fails: the chain stops at the heads entry and the next stage is not trained
    calls.unlink()
    for name in ("read_lm7", "mix_fit16-fit/int8"):
        shutil.rmtree(root / "runs/recipe" / name)
    fake.write_text(fake.read_text().replace('  export) mkdir -p "$5"', '  export) exit 3; mkdir -p "$5"'))
    proc = subprocess.run(chain, cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    _wait(root / "runs/recipe/chain.pid", 120)
    tail = (root / "runs/recipe/chain.log").read_text()[len(log) :]
    assert "mix_fit16: failed (exit 3), see runs/recipe/heads.log" in tail
    assert not any("read_lm7" in c for c in calls.read_text().splitlines())
    assert "stopped by an error (exit 3)" in (root / "runs/recipe/heads.log").read_text()


def test_a_chain_refuses_an_unknown_heads_entry(tmp_path):
    root = _with_stand_in_cepe(tmp_path, 0)
    proc = subprocess.run(
        ["bash", "scripts/train_chain.sh", "fast_warmup", "heads:nope"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "no such stage: configs/train/recipe/nope.yaml" in proc.stderr
    assert not (root / "runs/recipe/chain.log").exists()


def _alloc(tmp_path: Path, **env: str) -> tuple[str, str]:
    """(LD_PRELOAD and MALLOC_CONF after sourcing scripts/fast_alloc.sh, what it said on stderr)."""
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", "CEPE_MALLOC")}
    proc = subprocess.run(
        ["bash", "-c", '. scripts/fast_alloc.sh; echo "${LD_PRELOAD:-}|${MALLOC_CONF:-}"'],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr.strip()


def test_fast_alloc_preloads_the_named_jemalloc_and_nothing_else(tmp_path):
    """A library named by CEPE_JEMALLOC is preloaded with memory kept for reuse; CEPE_MALLOC=system or an
    LD_PRELOAD already set leaves the environment alone; a missing library is said, not preloaded."""
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")  # sourcing only sets the environment; nothing is loaded here
    out, said = _alloc(tmp_path, CEPE_JEMALLOC=str(lib))
    assert out == f"{lib}|oversize_threshold:0,background_thread:false,dirty_decay_ms:-1,muzzy_decay_ms:-1"
    assert said == f"allocator: jemalloc ({lib}, MALLOC_CONF={out.split('|')[1]})"
    assert _alloc(tmp_path, CEPE_JEMALLOC=str(lib), MALLOC_CONF="narenas:1")[0] == f"{lib}|narenas:1"
    assert _alloc(tmp_path, CEPE_JEMALLOC=str(lib), CEPE_MALLOC="system") == ("|", "")
    assert _alloc(tmp_path, CEPE_JEMALLOC=str(lib), LD_PRELOAD="other.so")[0] == "other.so|"
    out, said = _alloc(tmp_path, CEPE_JEMALLOC=str(tmp_path / "missing.so"))
    assert out == "|" and said.startswith("allocator: the system malloc")


def test_heads_and_validate_runs_under_jemalloc_where_there_is_one(tmp_path):
    """The heads fit and evaluations purge jemalloc's kept pages (after each recorded step, each item), so
    heads_and_validate.sh preloads it as training does (scripts/fast_alloc.sh): every cepe call runs under it;
    a preload passed down (the chain's, or the user's) stays, and CEPE_MALLOC=system keeps glibc's malloc."""
    root, _, calls = _heads_tree(tmp_path)
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")  # an empty stand-in: the loader says so on stderr and runs each call without it
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", "CEPE_MALLOC")}
    for env, want in (
        ({"CEPE_JEMALLOC": str(lib)}, str(lib)),
        ({"CEPE_JEMALLOC": str(lib), "LD_PRELOAD": "libother.so"}, "libother.so"),
        ({"CEPE_JEMALLOC": str(lib), "CEPE_MALLOC": "system"}, None),
    ):
        for p in root.glob("results/recipe/mix_fit14*"):
            shutil.rmtree(p)
        shutil.rmtree(root / "runs/recipe/mix_fit14-fit", ignore_errors=True)
        Path(f"{calls}.preload").unlink(missing_ok=True)
        _heads_mix_fit14(root, {**base, **env})
        seen = Path(f"{calls}.preload")
        lines = seen.read_text().splitlines() if seen.exists() else []
        called = len(calls.read_text().splitlines())
        calls.unlink()
        if want is None:
            assert lines == []
        else:
            assert len(lines) == called > 0 and all(line.endswith(f" {want}") for line in lines)


_FAKE_TIME = r"""#!/usr/bin/env bash
# stands in for GNU time: -o FILE -f FORMAT CMD...; writes fixed figures, runs CMD
out=$2; shift 4
"$@"; rc=$?
printf '12.5\t20.0\t1.5\t2097152\t1000\n' > "$out"
exit $rc
"""


def test_eval_alloc_ab_runs_each_config_under_both_allocators_and_compares_their_values(tmp_path):
    """eval_alloc_ab.sh alternates glibc and jemalloc (scripts/fast_alloc.sh through eval_val.sh) for each
    pair and config, tables each process's figures, and says whether every value is the same."""
    root, _, calls = _heads_tree(tmp_path)
    shutil.copy(ROOT / "scripts/eval_alloc_ab.sh", root / "scripts/eval_alloc_ab.sh")
    lib, timer = tmp_path / "libjemalloc.so.2", tmp_path / "fake_time"
    lib.write_bytes(b"")
    timer.write_text(_FAKE_TIME)
    timer.chmod(0o755)
    (root / "adapter").mkdir()
    (root / "adapter/cepe_config.json").write_text("{}")
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", "CEPE_MALLOC")}
    for skew, same in (("", "yes"), ("1", "NO")):
        proc = subprocess.run(
            ["bash", "scripts/eval_alloc_ab.sh", "adapter", f"out{skew}", "2"],
            cwd=root,
            capture_output=True,
            text=True,
            env={
                **base,
                "CEPE_JEMALLOC": str(lib),
                "GNU_TIME": str(timer),
                "SKEW": skew,
                "ONLY": "lm_val copy_val",
            },
        )
        assert proc.returncode == 0, proc.stderr
        got = json.loads((root / f"out{skew}/times.json").read_text())
        order = [(r["allocator"], r["pair"], r["config"]) for r in got["rows"]]
        assert order == [
            (a, p, c) for p in (1, 2) for a in ("system", "jemalloc") for c in ("lm_val", "copy_val")
        ]
        assert got["rows"][0]["wall_s"] == 12.5 and got["rows"][0]["peak_gib"] == 2.0
        assert got["same_values"] == {"lm_val": same == "yes", "copy_val": same == "yes"}
        assert f"copy_val {same}, lm_val {same}" in (root / f"out{skew}/times.md").read_text()
    preloads = Path(f"{calls}.preload").read_text().splitlines()
    assert len(preloads) == 8 and all(line == f"eval {lib}" for line in preloads)  # the jemalloc runs only


def test_a_stage_killed_by_another_signal_is_a_failure(tmp_path):
    """Only the stops a run is asked for (SIGHUP, SIGINT, SIGTERM) stop the chain quietly; a stage killed
    by the out-of-memory killer (SIGKILL) crashed, and a rerun would crash the same way."""
    log = _run_chain_with_exit(tmp_path, 128 + 9)
    assert "fast_warmup: failed (exit 137), see runs/recipe/fast_warmup.log" in log
    assert "stopped by signal" not in log


def test_a_second_chain_is_refused_while_a_stage_of_the_first_runs(tmp_path):
    """The chain's lock is held by its stage too: with the chain's own process gone (its pid file removed
    here) a second chain is still refused while the stage runs, and starts once it has ended."""
    root = _with_stand_in_cepe(tmp_path, 0)
    (root / "fakebin/cepe").write_text("#!/usr/bin/env bash\nsleep 3\nexit 143\n")
    start = ["bash", "scripts/train_chain.sh", "fast_warmup"]
    subprocess.run(start, cwd=root, check=True)
    pidfile = root / "runs/recipe/chain.pid"
    first = pidfile.read_text()
    pidfile.unlink()
    second = subprocess.run(start, cwd=root, capture_output=True, text=True)
    assert second.returncode == 2 and "a chain is running already" in second.stderr
    time.sleep(4)
    subprocess.run(start, cwd=root, check=True)  # the first has ended: the lock is free
    assert pidfile.read_text() != first
    _wait(pidfile)


def test_a_heads_run_the_chain_lists_is_left_to_the_chain(tmp_path):
    """``heads_and_validate.sh NAME`` beside a running chain that lists ``heads:NAME`` is refused: it would
    hold the heads pid file when the chain reached that entry, and the chain would stop there as failed."""
    root = _with_stand_in_cepe(tmp_path, 0)
    shutil.copy(ROOT / "scripts/heads_and_validate.sh", root / "scripts/heads_and_validate.sh")
    (root / "fakebin/cepe").write_text("#!/usr/bin/env bash\nsleep 3\nexit 143\n")
    subprocess.run(["bash", "scripts/train_chain.sh", "fast_warmup", "heads:mix_fit16"], cwd=root, check=True)
    heads = subprocess.run(
        ["bash", "scripts/heads_and_validate.sh", "mix_fit16"], cwd=root, capture_output=True, text=True
    )
    assert heads.returncode == 2 and "runs heads:mix_fit16 itself" in heads.stderr
    assert not (root / "runs/recipe/heads.pid").exists()
    # one the chain has judged already may be run again (a failed evaluation fixed); a name that only
    # begins like a listed one is not the chain's
    (root / "results/recipe/mix_fit16").mkdir(parents=True)
    (root / "results/recipe/mix_fit16/val_verdict.md").write_text("judged\n")
    for name in ("mix_fit16", "mix_fit1"):
        again = subprocess.run(
            ["bash", "scripts/heads_and_validate.sh", name], cwd=root, capture_output=True, text=True
        )
        assert again.returncode == 0 and "itself" not in again.stderr
        _wait(root / "runs/recipe/heads.pid")
    _wait(root / "runs/recipe/chain.pid")


def test_a_failed_evaluation_is_not_run_again_on_the_same_adapter_without_retry(tmp_path):
    """The chain reruns its heads entries at every restart: an evaluation that failed on this adapter is
    skipped then (it could cost the same minutes each time), run again with RETRY=1, and again on its own
    once the adapter is exported anew."""
    root, fake, calls = _heads_tree(tmp_path, "FAIL_EVAL=fixedppl_val_short_kernel")
    run = ["bash", "scripts/heads_and_validate.sh", "mix_fit14"]

    def evals(env=None) -> list[str]:
        if calls.exists():
            calls.unlink()
        proc = subprocess.run(run, cwd=root, capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        _wait(root / "runs/recipe/heads.pid", 120)
        return (
            [c for c in calls.read_text().splitlines() if c.startswith("cepe eval")] if calls.exists() else []
        )

    assert len(evals()) == 9
    assert evals() == []
    assert (
        "fixedppl_val_short_kernel failed before on this adapter"
        in (root / "runs/recipe/heads.log").read_text()
    )
    assert len(evals({**os.environ, "RETRY": "1"})) == 1
    shutil.rmtree(root / "runs/recipe/mix_fit14-fit/int8")  # exported anew
    time.sleep(0.01)
    assert len(evals()) == 1


def test_the_chains_heads_entry_waits_for_a_heads_run_started_by_hand(tmp_path):
    """The chain's ``heads:NAME`` entry (FOREGROUND=1) beside a heads run started by hand (a rerun with
    RETRY=1, say) waits for it, then does what is left: it stopped the chain as failed."""
    root, _, calls = _heads_tree(tmp_path)
    other = subprocess.Popen(["bash", "-c", "sleep 2; true", "pipeline"])  # a heads run's command line
    (root / "runs/recipe/heads.pid").write_text(str(other.pid))
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", "scripts/heads_and_validate.sh", "mix_fit14"],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "FOREGROUND": "1"},
    )
    other.wait()
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started >= 1.5
    log = (root / "runs/recipe/heads.log").read_text()
    assert "waiting for the running heads run" in log and "mix_fit14: done" in log


def test_a_heads_recipe_over_the_shipped_reader_gets_it_exported(tmp_path):
    """``mix_fit3e`` fits over ``runs/given/shipped_reader`` (through ``extends``, which no machine has
    until it is exported): the heads step exports it from the shipped adapter once, then fits."""
    root, _, calls = _heads_tree(tmp_path)
    run = ["bash", "scripts/heads_and_validate.sh", "mix_fit3e"]
    assert subprocess.run(run, cwd=root, capture_output=True, text=True).returncode == 0
    _wait(root / "runs/recipe/heads.pid", 120)
    made = calls.read_text().splitlines()
    want = "cepe export --model adapters/smollm2-135m-cepe --out runs/given/shipped_reader --drop-mixture"
    assert made.count(want) == 1 and made.index(want) < next(
        i for i, c in enumerate(made) if c.startswith("cepe fit-heads")
    )
    (root / "runs/recipe/mix_fit3e-fit/fit.md").unlink()  # fitted again: the reader is there already
    calls.unlink()
    assert subprocess.run(run, cwd=root, capture_output=True, text=True).returncode == 0
    _wait(root / "runs/recipe/heads.pid", 120)
    assert want not in calls.read_text()
