"""`conveyor run --image FILE -p ...` on a tiny Gemma 3 directory: the image goes into the first message."""

import pytest
from tiny_gemma3_vision import random_image, write_model_dir

from conveyor.cli import main

transformers = pytest.importorskip("transformers")


def test_run_with_an_image(tmp_path, capsys):
    write_model_dir(tmp_path / "model", transformers)
    random_image(0).save(tmp_path / "a.png")
    argv = ["run", "-m", str(tmp_path / "model"), "-p", "What?", "-n", "3", "--temperature", "0"]
    assert main(argv + ["--image", str(tmp_path / "a.png")]) == 0
    assert "invalid request" not in capsys.readouterr().err
    with pytest.raises(SystemExit, match="1"):
        main(argv + ["--image", str(tmp_path / "missing.png")])
    assert "--image" in capsys.readouterr().err
