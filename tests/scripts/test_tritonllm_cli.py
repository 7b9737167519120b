"""The installed ``tritonllm`` command: ``tritonllm serve CHECKPOINT [options]`` is
``make serve MODEL=CHECKPOINT`` (scripts/serve_default.py --model); ``launch``, ``fill-template``
and ``templates`` are the launcher, fill_template and the model-repository templates, named in
``tritonllm --help``."""
import re

import pytest

from tritonllm.cli import COMMANDS, main
from tritonllm.paths import FIVE_MODELS, model_templates_dir


def test_serve_takes_the_checkpoint_as_its_first_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path))
    with pytest.raises(SystemExit, match="checkpoint /no/such/model does not exist"):
        main(["serve", "/no/such/model", "--max_seq_len", "256"])


def test_unknown_commands_are_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit, match="unknown command 'run'; commands: serve, launch, fill-template, templates"):
        main(["run", "model"])
    main([])
    out = capsys.readouterr().out
    assert out.startswith("usage: tritonllm {serve,launch,fill-template,templates}")
    assert all(f"tritonllm {command} " in out for command in COMMANDS)  # each named with its arguments


@pytest.mark.parametrize("command,prog", [("serve", "tritonllm serve"), ("launch", "tritonllm launch"),
                                          ("fill-template", "tritonllm fill-template"),
                                          ("templates", "tritonllm templates")])
def test_each_command_has_its_own_help(command, prog, capsys):
    with pytest.raises(SystemExit) as raised:
        main([command, "--help"])
    assert raised.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {prog} ")


def test_templates_copy_the_five_models_then_fill_template_fills_one(tmp_path, capsys):
    main(["templates"])
    assert capsys.readouterr().out.strip() == str(model_templates_dir())
    main(["templates", str(tmp_path / "repo")])
    repo = tmp_path / "repo"
    assert sorted(p.name for p in repo.iterdir()) == sorted(FIVE_MODELS)  # not the llmapi repository
    assert (repo / "tensorrt_llm" / "1" / "model.py").is_file() and (repo / "ensemble" / "1").is_dir()
    assert not list(repo.rglob("__pycache__"))
    config = repo / "preprocessing" / "config.pbtxt"
    main(["fill-template", "-i", str(config), "tokenizer_dir:/engines/x,triton_max_batch_size:4"])
    text = config.read_text()
    assert 'string_value: "/engines/x"' in text and "max_batch_size: 4" in text
    assert "${triton_max_batch_size}" not in text and re.search(r"\$\{\w+\}", text)  # others stay
    with pytest.raises(SystemExit, match="exists"):
        main(["templates", str(repo)])
    main(["templates", "--llmapi", str(tmp_path / "llmapi")])
    assert (tmp_path / "llmapi" / "tensorrt_llm" / "1" / "model.yaml").is_file()


def test_serve_refuses_lora_on_an_encoder_decoder_checkpoint_by_name(tmp_path):
    """Encoder-decoder checkpoints are served (tests/scripts/test_serve_encoder_decoder.py); LoRA on them is not."""
    (tmp_path / "config.json").write_text('{"architectures": ["WhisperForConditionalGeneration"]}')
    with pytest.raises(SystemExit, match="--lora_modules: WhisperForConditionalGeneration \\(encoder-decoder\\)"):
        main(["serve", str(tmp_path), "--lora_modules", "a=/adapters/a"])
