"""Progress bars only on rank 0 with a terminal: none in a pipe (CI, SLURM), where the line logs
of examples/train.py and the checkpoint code are the record."""

import io
import os
import subprocess
import sys

import torch

import zero
from zero.checkpoint import consolidate
from zero.progress import bar_enabled, progress

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_only_on_rank_zero_with_a_terminal(monkeypatch):
    assert bar_enabled(0, Terminal()) and not bar_enabled(1, Terminal())
    assert not bar_enabled(0, io.StringIO())
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(progress(range(3), "work")) == [0, 1, 2]
    assert "work" in terminal.getvalue()
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    assert list(progress(range(3), "work")) == [0, 1, 2]
    assert piped.getvalue() == ""


def test_checkpoint_bars_only_with_a_terminal(tmp_path, capfd, monkeypatch):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    engine, _, _, _ = zero.initialize(model=torch.nn.Linear(4, 3), config=config)
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    engine.save_checkpoint(tmp_path)
    engine.load_checkpoint(tmp_path)
    assert set(consolidate(str(tmp_path))) == {"weight", "bias"}
    out, err = capfd.readouterr()
    assert "\r" not in out + err and "it/s" not in err and "|" not in err, err
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    engine.load_checkpoint(tmp_path)
    assert "load" in terminal.getvalue() and "range" in terminal.getvalue()


def test_train_logs_lines_without_terminal(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a small corpus of plain text to train a tiny model on.\n" * 200)
    config = tmp_path / "zero.json"
    config.write_text(
        '{"train_micro_batch_size_per_gpu": 4, "steps_per_print": 2,'
        ' "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}'
    )
    command = [sys.executable, "examples/train.py", "--config", str(config), "--data", str(corpus)]
    command += ["--n_layer", "1", "--n_embd", "16", "--block_size", "8", "--steps", "4"]
    command += ["--eval_batches", "1"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # One line per logged step, one loss: the engine's own step line (rank 0's loss) is off.
    lines = [line for line in result.stdout.splitlines() if line.startswith("step=")]
    assert [line.split()[0] for line in lines] == ["step=2", "step=4"], result.stdout
    assert all(line.count("loss=") == 1 and "tokens/s=" in line for line in lines)
    assert "step=" not in result.stderr, result.stderr
    assert "\r" not in result.stdout + result.stderr, result.stderr
