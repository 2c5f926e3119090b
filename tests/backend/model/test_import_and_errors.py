"""GGUF import failures are clean; bad checkpoints fail with errors that name the file and the value."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from edgeinfer.backend.model.gguf_import import ModelImportError, default_gguf_path, import_gguf
from edgeinfer.backend.model.loader import load_model
from edgeinfer.backend.model.model_config import CheckpointError, ModelConfig
from edgeinfer.protocol.tokenizer import Tokenizer, TokenizerError


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeinfer.ops.cli", "model", "import", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("kind", ["truncated-header", "truncated-tensors", "not-gguf", "missing"])
def test_import_of_bad_file_fails_clearly_and_leaves_nothing(tmp_path, kind):
    src = tmp_path / "bad.gguf"
    real = default_gguf_path()
    if kind == "truncated-header":
        src.write_bytes(real.read_bytes()[:3000])
    elif kind == "truncated-tensors":
        src.write_bytes(real.read_bytes()[: real.stat().st_size // 2])
    elif kind == "not-gguf":
        src.write_text("this is not a model\n" * 100)
    dst = tmp_path / "out" / "model"
    r = _cli(str(src), str(dst))
    assert r.returncode == 1
    msg = r.stderr
    assert "edgeinfer model import: error:" in msg and str(src) in msg
    expect = {"truncated-header": "GGUF", "truncated-tensors": "truncated", "not-gguf": "not a GGUF file",
              "missing": "no such file"}[kind]
    assert expect in msg
    assert not dst.exists()
    leftovers = list((tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    assert leftovers == []


def test_import_refuses_non_empty_destination(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("user data")
    with pytest.raises(ModelImportError, match="not empty"):
        import_gguf(default_gguf_path(), dst, progress=False)
    assert (dst / "keep.txt").read_text() == "user data"


@pytest.fixture
def ckpt(tmp_path, smol_dir):
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in smol_dir.iterdir():
        (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    shutil.copy(smol_dir / "config.json", d / "config.json")
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,needle", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope type 'dynamic'"),
    ({"hidden_size": -4}, "hidden_size=-4"),
    ({"num_hidden_layers": None}, "missing required key 'num_hidden_layers'"),
    ({"num_key_value_heads": 4}, "num_attention_heads=9 is not a multiple of num_key_value_heads=4"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_bad_config_names_file_and_value(ckpt, changes, needle):
    _edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_dir(ckpt)
    assert needle in str(e.value) and "config.json" in str(e.value)


def test_missing_or_malformed_checkpoint(tmp_path, ckpt):
    with pytest.raises(CheckpointError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")
    (ckpt / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="malformed JSON"):
        ModelConfig.from_dir(ckpt)


def test_wrong_tensor_shape_and_missing_weights(tmp_path, ckpt):
    _edit_config(ckpt, intermediate_size=1000)
    with pytest.raises(CheckpointError, match=r"gate_proj.weight' has shape \(1536, 576\), expected \(1000, 576\)"):
        load_model(ckpt)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(ckpt / "config.json", empty / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_model(empty)


def test_tokenizer_mismatch_and_missing(tmp_path, smol_dir):
    with pytest.raises(TokenizerError, match="tokenizer has 49152 tokens but the model's vocab_size is 1000"):
        Tokenizer.from_dir(smol_dir, model_vocab_size=1000)
    with pytest.raises(TokenizerError, match="tokenizer.json: missing"):
        Tokenizer.from_dir(tmp_path)
