"""The installed ``tritonllm`` command: ``tritonllm serve CHECKPOINT [options]`` is
``make serve MODEL=CHECKPOINT`` (scripts/serve_default.py --model)."""
import pytest

from tritonllm.cli import main


def test_serve_takes_the_checkpoint_as_its_first_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path))
    with pytest.raises(SystemExit, match="checkpoint /no/such/model does not exist"):
        main(["serve", "/no/such/model", "--max_seq_len", "256"])


def test_unknown_commands_are_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit, match="unknown command 'run'; commands: serve"):
        main(["run", "model"])
    main([])
    assert capsys.readouterr().out.startswith("usage: tritonllm serve [CHECKPOINT] [options]")
