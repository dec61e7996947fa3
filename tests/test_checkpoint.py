"""Loading the official checkpoint layout: every file problem is named, shards load, unsupported
kinds are refused, the 0.6B size drops instructs."""
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tts_cli.checkpoint import open_checkpoint
from tts_cli.errors import CheckpointError, RequestError, UnsupportedModelError
from tts_cli.request import Request
from tts_cli.synthesizer import Synthesizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tts_cli" / "assets" / "tiny-1.7b-customvoice"
TINY_06 = ROOT / "tests" / "fixtures" / "tiny-0.6b-customvoice"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return Path(shutil.copytree(TINY, tmp_path / "ckpt"))


def _edit_config(ckpt: Path, edit) -> None:
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_reads_ids_and_tables_from_config():
    cfg = open_checkpoint(TINY).config
    assert (cfg.im_start_id, cfg.tts_pad_id, cfg.codec_eos_id) == (1001, 1028, 2150)
    assert cfg.speaker_ids["vivian"] == 3065 and cfg.speaker_dialects == {"eric": "sichuan_dialect",
                                                                          "dylan": "beijing_dialect"}
    assert "beijing_dialect" not in cfg.languages and cfg.languages[0] == "auto"
    assert open_checkpoint(TINY).sampling.repetition_penalty == 1.05


def test_missing_model_dir(tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found: .*nowhere"):
        open_checkpoint(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_missing_file_is_named(ckpt, name):
    (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=f"missing.*{name}"):
        open_checkpoint(ckpt)


def test_missing_speech_tokenizer(ckpt):
    shutil.rmtree(ckpt / "speech_tokenizer")
    with pytest.raises(CheckpointError, match="speech_tokenizer"):
        open_checkpoint(ckpt)


@pytest.mark.parametrize("name", ["model.safetensors", "speech_tokenizer/model.safetensors",
                                  "speech_tokenizer/config.json"])
def test_a_missing_weights_or_codec_file_is_named_before_any_tensor_loads(ckpt, name):
    (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=f"missing file: .*{name}"):
        open_checkpoint(ckpt)


def test_malformed_json_is_named(ckpt):
    (ckpt / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="malformed JSON in .*generation_config.json"):
        open_checkpoint(ckpt)


def test_missing_field_is_named(ckpt):
    _edit_config(ckpt, lambda c: c["talker_config"].pop("codec_bos_id"))
    with pytest.raises(CheckpointError, match="config.json -> talker_config: missing field 'codec_bos_id'"):
        open_checkpoint(ckpt)


def test_wrong_field_type_is_named(ckpt):
    _edit_config(ckpt, lambda c: c.update(tts_pad_token_id="pad"))
    with pytest.raises(CheckpointError, match="field 'tts_pad_token_id' should be int"):
        open_checkpoint(ckpt)


@pytest.mark.parametrize("key, name, value", [("spk_id", "vivian", "abc"), ("spk_id", "Ryan", 3072),
                                               ("spk_id", "eric", True), ("codec_language_id", "english", [1, 2]),
                                               ("codec_language_id", "german", -1)])
def test_a_speaker_or_language_id_that_is_no_codec_id_is_named_before_the_run(ckpt, tmp_path, key, name, value):
    """Read only when a row names it, such an id failed the whole run mid-synthesis, its folder made; now the
    checkpoint is refused naming the file, field and entry, before --out is made (exit 2)."""
    from typer.testing import CliRunner

    from tts_cli import cli

    def edit(c):
        c["talker_config"][key].pop(name.lower())
        c["talker_config"][key][name] = value
    _edit_config(ckpt, edit)
    message = (f"config.json -> talker_config: field '{key}': '{name}' should be a codec id, an integer from 0 to "
               f"vocab_size - 1 (3071), got {value!r}")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        open_checkpoint(ckpt)
    (tmp_path / "m.txt").write_text("Hello.\n")
    result = CliRunner().invoke(cli.app, ["synth", str(tmp_path / "m.txt"), "--out", str(tmp_path / "out"), "--model",
                                          str(ckpt), "--no-wer", "--max-frames", "4", "--speaker", "eric"])
    assert result.exit_code == 2 and message in " ".join(result.stderr.split()), result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value, says", [
    ("temperature", -1.0, "should be > 0"), ("temperature", 0.0, "should be > 0"),
    ("subtalker_temperature", 0, "should be > 0"), ("repetition_penalty", 0.0, "should be > 0"),
    ("top_k", -5, "should be >= 0"), ("subtalker_top_k", -1, "should be >= 0"),
    ("top_p", 7.0, "should be from 0 to 1"), ("subtalker_top_p", -0.5, "should be from 0 to 1"),
    ("max_new_tokens", 0, "should be >= 2"), ("max_new_tokens", 1, "should be >= 2")])
def test_a_sampling_setting_out_of_bounds_is_named(ckpt, key, value, says):
    """A negative temperature turned the distribution over and max_new_tokens 0 made every row empty audio
    reported ok, without a word: generation_config.json's settings are held to the bounds of HF's warpers."""
    path = ckpt / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    with pytest.raises(CheckpointError, match=re.escape(f"generation_config.json: field '{key}' {says}, got ")):
        open_checkpoint(ckpt)


def test_a_temperature_is_not_checked_where_that_sampler_does_not_sample(ckpt):
    path = ckpt / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_sample": False, "temperature": 0.0,
                                "subtalker_dosample": False, "subtalker_temperature": 0.0}))
    assert open_checkpoint(ckpt).sampling.temperature == 0.0


def test_an_unknown_model_type_is_refused(ckpt):
    _edit_config(ckpt, lambda c: c.update(tts_model_type="voice_conversion"))
    with pytest.raises(UnsupportedModelError, match="tts_model_type 'voice_conversion' is not supported; tts "
                                                    "synthesizes custom_voice, base, voice_design checkpoints"):
        open_checkpoint(ckpt)


def test_missing_tensor_is_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["talker.code_predictor.lm_head.3.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'talker.code_predictor.lm_head.3.weight'"):
        Synthesizer.from_pretrained(ckpt)


def test_misshapen_and_unexpected_tensors_are_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["talker.codec_head.weight"] = tensors["talker.codec_head.weight"][:, :8].contiguous()
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'talker.codec_head.weight' has shape"):
        Synthesizer.from_pretrained(ckpt)
    tensors = load_file(str(TINY / "model.safetensors"))
    tensors["speaker_encoder.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor 'speaker_encoder.fc.weight'"):
        Synthesizer.from_pretrained(ckpt)


def test_corrupt_safetensors_is_named(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="malformed safetensors file .*model.safetensors"):
        Synthesizer.from_pretrained(ckpt)


def test_sharded_checkpoint_loads_the_same_weights(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(ckpt / shard))
    (ckpt / "model.safetensors").unlink()
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = Synthesizer.from_pretrained(ckpt).model.state_dict()
    single = Synthesizer.from_pretrained(TINY).model.state_dict()
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)

    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing file: .*model-00002-of-00002.safetensors"):
        Synthesizer.from_pretrained(ckpt)


def test_unknown_speaker_and_language_list_the_valid_values():
    synth = Synthesizer.from_pretrained(TINY)
    with pytest.raises(RequestError, match="unknown speaker 'nobody'; valid: aiden, dylan, eric"):
        synth.validate(Request(id="x", text="Hello.", speaker="nobody"))
    with pytest.raises(RequestError, match="unknown language 'klingon'; valid: auto, chinese, english"):
        synth.validate(Request(id="x", text="Hello.", speaker="vivian", language="klingon"))
    with pytest.raises(RequestError, match="unknown language 'beijing_dialect'"):
        synth.validate(Request(id="x", text="Hello.", speaker="dylan", language="beijing_dialect"))


@pytest.mark.parametrize("text", ["", "  \n", "\u200b\u200d", "\u2060 \ufeff"])
def test_a_request_with_nothing_to_speak_is_refused_by_the_manifests_rule(text):
    """A library caller's request meets the manifest's rule for empty text (whitespace and invisible formatting
    characters alone), not a looser strip()."""
    with pytest.raises(RequestError, match="^empty text$"):
        Synthesizer.from_pretrained(TINY).validate(Request(id="x", text=text, speaker="vivian"))


def test_small_model_ignores_instructs_with_a_note(caplog):
    synth = Synthesizer.from_pretrained(TINY_06)
    assert not synth.supports_instruct
    plain = synth.prompt(Request(id="a", text="Hello there.", speaker="aiden", language="english"))
    with caplog.at_level(logging.INFO):
        instructed = synth.prompt(Request(id="b", text="Hello there.", speaker="aiden", language="english",
                                          instruct="Whisper."))
    assert instructed == plain
    note = ("instructions ignored: this CustomVoice 0.6B checkpoint does not support them (as the official "
            "implementation does)")
    assert note in caplog.text and synth.notes == [note]   # the notes reach the report
    big = Synthesizer.from_pretrained(TINY)
    with_instruct = big.prompt(Request(id="b", text="Hello there.", speaker="aiden", instruct="Whisper."))
    assert len(with_instruct) > len(big.prompt(Request(id="a", text="Hello there.", speaker="aiden")))


def test_fp16_weights_are_the_bf16_ones_unless_one_is_beyond_fp16s_range(ckpt, caplog):
    from tts_cli.model.qwen3_tts import Qwen3TTS
    stored = load_file(str(ckpt / "model.safetensors"))
    model = Qwen3TTS.from_checkpoint(open_checkpoint(ckpt), dtype=torch.float16)
    weight, bf16 = model.talker.codec_head.weight, stored["talker.codec_head.weight"].float()
    # bf16 values convert exactly down to 2^-17; below, fp16's subnormals keep multiples of 2^-24
    normal = bf16.abs() >= 2 ** -17
    assert weight.dtype == torch.float16 and torch.equal(weight.float()[normal], bf16[normal])
    assert (weight.float() - bf16).abs().max() <= 2 ** -25
    stored["talker.codec_head.weight"][3, 5] = 1e5
    save_file(stored, str(ckpt / "model.safetensors"))
    with caplog.at_level(logging.WARNING):
        model = Qwen3TTS.from_checkpoint(open_checkpoint(ckpt), dtype=torch.float16)
    assert model.talker.codec_head.weight.dtype == torch.bfloat16
    assert "talker.codec_head.weight has values beyond fp16's range" in caplog.text
