"""Command-line reports and bad-input errors: the size ``cepe export`` prints, the device the evaluation's
memory meter reads, and ``cepe serve`` settings that cannot serve."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import randomize_cross, tiny_cepe_config, tiny_decoder

from cepe import CepeForCausalLM
from cepe.cli import main


def test_export_prints_the_size_of_the_adapter_it_wrote(tmp_path, capsys):
    """The printed size counted every file in ``--out``: a directory that holds other files (a run's
    folder, ``.``) reported them as the adapter's size."""
    from cepe.modeling import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    dec_dir = tmp_path / "decoder"
    tiny_decoder().save_pretrained(dec_dir)
    model = CepeForCausalLM.from_decoder(str(dec_dir), tiny_cepe_config()).eval()
    randomize_cross(model)
    model.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.bin").write_bytes(b"\0" * (3 * 2**20))  # another file in the folder
    assert (
        main(["export", "--model", str(tmp_path / "adapter"), "--out", str(out), "--quantize", "int8"]) == 0
    )
    printed = float(re.search(r"\(([\d.]+) MiB\)", capsys.readouterr().out).group(1))
    size = sum((out / name).stat().st_size for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG))
    assert printed == round(size / 2**20, 1)


def test_meter_reads_the_memory_of_its_own_cuda_device(monkeypatch):
    """A meter on ``cuda:1`` synchronised, reset and read the current device (``cuda:0``): its peak was
    another device's (0 MB where nothing ran there)."""
    from cepe.measure import Meter

    seen = []

    def record(name, value=0):
        def fn(device=None):
            seen.append((name, device))
            return value

        return fn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", record("synchronize"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", record("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", record("allocated", 2**20))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", record("peak", 3 * 2**20))
    meter = Meter("cuda:1")
    with meter.measure(10):
        pass
    assert seen and all(device == torch.device("cuda:1") for _, device in seen), seen
    assert meter.summary()["peak_memory_mb"] == 3.0 and meter.summary()["rss_delta_mb"] == 2.0


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"threads": -1}, r"--threads must be 0 \(torch's default\) or more, got -1"),
        ({"port": 70000}, "--port"),
    ],
)
def test_serve_refuses_threads_and_ports_that_cannot_serve(tmp_path, setting, message):
    """``--threads -1`` ended in torch's RuntimeError traceback (after the serve imports); a port over 65535
    got as far as the server. Both are now a ValueError that names the flag, before anything loads."""
    from cepe.serve_config import ServeConfig
    from cepe.store_cli import run_server

    cfg = ServeConfig(store=str(tmp_path / "store"), model="tiny", host="0.0.0.0", **setting)
    with pytest.raises(ValueError, match=message):
        run_server(cfg, api_key=None)  # (no key on a public host: refused too, after these checks)


def test_atomic_write_keeps_the_permissions_of_the_file_it_replaces(tmp_path):
    """As ``open(path, "w")`` would: a file made private stays private when written again (before, every
    rewrite gave it ``0o666`` minus the umask, e.g. 0644 for a file its owner had set to 0600); a new file
    still gets ``0o666`` minus the umask, and ``mode`` still wins."""
    from cepe.fileio import umask, write_json, write_text

    path = tmp_path / "private.json"
    path.write_text("{}")
    private = 0o600 if 0o666 & ~umask() != 0o600 else 0o640
    path.chmod(private)
    write_json(path, {"a": 1})
    assert path.stat().st_mode & 0o7777 == private and path.read_text() == '{\n  "a": 1\n}\n'
    write_text(tmp_path / "new.txt", "x")
    assert (tmp_path / "new.txt").stat().st_mode & 0o7777 == 0o666 & ~umask()
    write_text(path, "y", mode=0o644)
    assert path.stat().st_mode & 0o7777 == 0o644
